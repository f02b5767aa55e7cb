"""What users do with the builds: pull a device's build from the remote (``pull``),
version and tag it (``release``), serve it (``serve``), and the container images that
run the stages (``images``, ``container``)."""
