"""glm-pd for SGLang: the ``glm-pd`` disaggregation transfer backend (see ``plugin.register``)."""
