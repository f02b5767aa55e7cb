"""The ground every other layer stands on, standard library only: the one error type
(``errors``), bounded reading and hashing of what users hand edgepath (``files``),
atomic writes (``atomic``), typed versioned records (``records``) and commands
(``command``)."""
