from weaver.config.deployment import (
    Deployment,
    ModelSpec,
    Role,
    WeavingSpec,
    load_deployment,
    parse_deployment,
)

__all__ = ["Deployment", "ModelSpec", "Role", "WeavingSpec", "load_deployment", "parse_deployment"]
