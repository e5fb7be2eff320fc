"""The `omniduplex` commands behind :mod:`web.cli`: ``serve`` (:mod:`~web.commands.serve`) and
``run`` (:mod:`~web.commands.run_once`); ``stage`` is :mod:`web.deploy.stages`, ``gateway``
:mod:`web.gateway.app`."""
