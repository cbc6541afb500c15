"""glm-pd test suites (a package so that tests.support resolves from the repository root)."""
