"""The decisions, in plain Python with no engine: the weight-path registry
(``weight_paths``), which layers a path quantizes (``shapes``), what a device is and
what a run stands for (``coverage``), a device's profile (``profile``), the selector
(``select``), the settings in params.yaml (``fleet``) and build versions (``versions``)."""
