"""Tables and figures rebuilt from records alone."""
