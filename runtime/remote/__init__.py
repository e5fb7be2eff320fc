"""Stages on other hosts: a stage host process (:mod:`runtime.remote.host`), the server's pool of
remote replicas found through the Redis registry (:mod:`runtime.remote.stages`), ZeroMQ for the
authenticated control messages (:mod:`runtime.remote.control`) and Mooncake's transfer engine for
the payloads (:mod:`runtime.remote.connector`). See docs/scaleout.md, "Stages on other hosts".
"""
