"""No-model engines: the null benchmark pipeline and a passthrough."""
