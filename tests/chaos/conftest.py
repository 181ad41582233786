"""The chaos tests run on the e2e tests' local Ray cluster (one per session)."""

from tests.e2e.conftest import ray_cluster, tiny_reference  # noqa: F401
