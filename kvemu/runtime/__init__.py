"""The async shell: event loops (wall or virtual time), transports and the router actor."""
