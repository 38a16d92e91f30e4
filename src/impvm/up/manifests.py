"""What ``impvm up`` applies from the package besides its configuration: verbatim copies of
deploy/rbac and deploy/admission, and the label of the objects it manages."""

from __future__ import annotations

from importlib import resources

from impvm.api.models import AGENT_LEASE_NAMESPACE

#: label of the objects this service applies from its configuration (and prunes when they
#: leave it); objects applied with kubectl do not carry it and are left alone
MANAGED_BY = {"app.kubernetes.io/managed-by": "impvm-up"}
SYSTEM_NAMESPACE = AGENT_LEASE_NAMESPACE
COMPONENTS = ("operator", "agent")


def rbac_manifest(component: str) -> str:
    """deploy/rbac/<component>.yaml as shipped in the package (a verbatim copy)."""
    return (resources.files("impvm.up") / "assets" / "rbac" / f"{component}.yaml").read_text()


def policy_manifest() -> str:
    """deploy/admission/agent.yaml as shipped in the package (a verbatim copy): the admission
    policies that hold each agent to its own node."""
    return (resources.files("impvm.up") / "assets" / "admission" / "agent.yaml").read_text()


def admission_manifests() -> list[str]:
    """deploy/admission/*.yaml as shipped in the package (verbatim copies), by file name."""
    folder = resources.files("impvm.up") / "assets" / "admission"
    return [
        f.read_text()
        for f in sorted(folder.iterdir(), key=lambda f: f.name)
        if f.name.endswith(".yaml")
    ]
