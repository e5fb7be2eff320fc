"""What one server process holds: the composition root (:mod:`~web.server.context`), how it builds
realtime cores and drivers (:mod:`~web.server.session_factory`), its metrics
(:mod:`~web.server.metrics`) and the REST view of its sessions (:mod:`~web.server.sessions_api`)."""
