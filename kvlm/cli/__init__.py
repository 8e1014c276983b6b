"""The command line (`kvlm ...`): one module per command, on top of everything, importing only public names."""
