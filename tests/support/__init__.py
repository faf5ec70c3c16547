"""The helpers tests share: where the repository and its data are
(``paths``), waiting on a condition (``waiting``), chat templates and their jinja2 reference
(``chat_templates``, ``jinja_reference``), the emulated workers' KV-event settings
(``kv_events``), a worker whose answers a test scripts (``fake_worker``), a fake Kubernetes
API server (``fake_kube``) and what a request takes on the machine now (``machine``).

Imported as ``from support.<module> import …`` everywhere: pytest puts ``tests/`` on the
path (``pythonpath`` in pyproject.toml)."""
