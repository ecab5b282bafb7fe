"""A local Ray instance that times out starting (a busy host's raylet) is started afresh once; any
other failure, or a second time-out, is raised as it came."""
from __future__ import annotations

import pytest

from deploy import launcher

TIMED_OUT = "The current node timed out during startup. This could happen because some of the raylet failed."


class FakeRay:
    def __init__(self, failures: list[Exception]):
        self.failures, self.inits, self.shutdowns = failures, 0, 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.inits += 1
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake_ray(monkeypatch):
    import sys

    def install(failures):
        ray = FakeRay(failures)
        monkeypatch.setitem(sys.modules, "ray", ray)
        return ray
    return install


def test_a_start_up_time_out_is_retried_once_with_a_fresh_instance(fake_ray, caplog):
    ray = fake_ray([Exception(TIMED_OUT)])
    launcher.init_ray(num_cpus=1)
    assert (ray.inits, ray.shutdowns) == (2, 1)
    assert "local Ray did not start (The current node timed out during startup)" in caplog.text


def test_a_second_time_out_or_another_error_is_raised(fake_ray):
    ray = fake_ray([Exception(TIMED_OUT), Exception(TIMED_OUT)])
    with pytest.raises(Exception, match="timed out during startup"):
        launcher.init_ray(num_cpus=1)
    assert ray.inits == launcher.LOCAL_START_ATTEMPTS
    ray = fake_ray([ValueError("num_cpus must be positive")])
    with pytest.raises(ValueError, match="num_cpus"):
        launcher.init_ray(num_cpus=1)
    assert (ray.inits, ray.shutdowns) == (1, 0)
