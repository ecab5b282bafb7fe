"""pdserve deployment: typed config (pools.yaml), cluster launcher files,
and (later) the planner, autoscaler and CLI."""
from deploy.config import (ConfigError, PDServeConfig, load_config,  # noqa: F401
                           parse_override)
