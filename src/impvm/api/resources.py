"""lightkube resource classes for the imp.dev/v1alpha1 kinds (generic: dict-like objects).

Parse an object's ``spec``/``status`` into the pydantic models of :mod:`impvm.api.models` with
``Model.model_validate(obj.to_dict())``.
"""

from __future__ import annotations

from typing import Any

from lightkube.generic_resource import create_global_resource, create_namespaced_resource

from impvm.api.models import GROUP, VERSION

ImpVMClassResource: Any = create_global_resource(GROUP, VERSION, "ImpVMClass", "impvmclasses")
ImpVMTemplateResource: Any = create_namespaced_resource(
    GROUP, VERSION, "ImpVMTemplate", "impvmtemplates"
)
ImpVMRunnerPoolResource: Any = create_namespaced_resource(
    GROUP, VERSION, "ImpVMRunnerPool", "impvmrunnerpools"
)
ImpVMResource: Any = create_namespaced_resource(GROUP, VERSION, "ImpVM", "impvms")
