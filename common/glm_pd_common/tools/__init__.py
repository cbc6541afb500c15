"""The ``glm-pd`` command line and what it runs: plan (the account), demo, doctor, and their renderings."""
