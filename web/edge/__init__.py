"""What every route and the gateway check before a session starts: the bind in keyless mode
(:mod:`~web.edge.auth`), bodies read with a byte limit and a deadline (:mod:`~web.edge.bodies`),
browser origins (:mod:`~web.edge.cors`), the one refusal vocabulary (:mod:`~web.edge.refusals`)
and uvicorn's protocols with a public server's deadlines (:mod:`~web.edge.uvicorn_guards`)."""
