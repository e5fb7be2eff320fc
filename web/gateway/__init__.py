"""`omniduplex gateway`: a stateless router in front of the replicas (:mod:`web.gateway.app`),
its state (:mod:`~web.gateway.state`), how it picks a replica (:mod:`~web.gateway.routing`),
relays WebSockets (:mod:`~web.gateway.relay`, :mod:`~web.gateway.ws_endpoint`) and forwards
HTTP (:mod:`~web.gateway.http_forward`; a deployment's workers forward with the same two)."""
