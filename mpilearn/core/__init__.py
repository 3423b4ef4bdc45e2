"""The core plumbing every layer uses: ranks and abort-on-error (``comm``), the config
schema (``config``), model loading (``builders``), defaults, flat buffers, atomic files."""
