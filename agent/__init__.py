"""wagent: moves model weights onto GPU nodes in the background, yielding to training traffic."""

__version__ = "0.1.0"
