"""Backend adapters, imported lazily by name (see :func:`runahead.backend.backend_module`)."""
