"""The async shell: event loops (wall or virtual time), transports, lifecycle hooks and the router actor."""
