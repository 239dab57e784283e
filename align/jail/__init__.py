"""The jail the python tool runs code in: kernel namespaces, a read-only root and limits, standard library only."""
