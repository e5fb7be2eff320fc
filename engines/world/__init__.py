"""World-model engines: tiny-jepa (pretrained, numpy), a random-weight text-to-video model, frame decode."""
