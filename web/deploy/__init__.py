"""How a server is deployed beyond one process: worker processes on one port (workers: the
supervisor and the shared sockets; worker_forward: a worker forwarding a request for a session
its sibling owns) and replicas behind a gateway (replica: registry lease, session binding with
epochs, the drain on SIGTERM)."""
