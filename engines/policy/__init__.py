"""Robot policies (π0-shaped action-chunk models) behind the runtime's engine interface."""
