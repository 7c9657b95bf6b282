"""One entry point per stage: `dormouse <stage> --job JSON`."""
