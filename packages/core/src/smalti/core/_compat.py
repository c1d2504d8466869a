"""Every private name of torch, pluggy, OmegaConf and Hydra that smalti-core uses, resolved once at import.

Other modules import these from here, never from the dependency's private modules, so an upgrade that moves a
name fails when ``smalti.core`` is imported (:class:`~smalti.core.errors.UnsupportedVersionError` naming the
version), not mid-run. ``PRIVATE_NAMES`` lists them for the test that checks each one.
"""

from __future__ import annotations

from typing import Any

import pluggy
from omegaconf import DictConfig, OmegaConf

from smalti.core.versions import private_name, unsupported

# --- torch: multi-tensor kernels (one launch for a list of tensors; EMA, SWA and SAM) ---
foreach_copy_ = private_name("torch", "_foreach_copy_")
foreach_lerp_ = private_name("torch", "_foreach_lerp_")
foreach_mul = private_name("torch", "_foreach_mul")
foreach_add_ = private_name("torch", "_foreach_add_")
#: The base class of every batch-norm layer (SWA recomputes their running statistics).
BatchNorm = private_name("torch.nn.modules.batchnorm", "_BatchNorm")

#: Whether a tensor is a functorch (vmap/grad) wrapper, whose data pointer is not its own (cpu_gemm refuses them).
is_functorch_wrapped_tensor = private_name("torch._C._functorch", "is_functorch_wrapped_tensor")

# --- Hydra: the modules whose functions smalti wraps to word config errors (hydra_errors, cli.report) ---
hydra_defaults_list = private_name("hydra._internal.defaults_list", distribution="hydra-core")
hydra_internal_utils = private_name("hydra._internal.utils", distribution="hydra-core")
if not hasattr(hydra_defaults_list, "config_not_found_error"):
    raise unsupported("hydra-core", "hydra._internal.defaults_list.config_not_found_error")
if not hasattr(hydra_internal_utils, "run_and_report"):
    raise unsupported("hydra-core", "hydra._internal.utils.run_and_report")


# --- pluggy: the fast hook path (core.dispatch) reads a hook's implementation list and the call executor ---
def _probe_pluggy() -> Any:
    """A plugin manager's plain hook executor (pluggy's ``_multicall``), checking the fields dispatch reads."""
    pm = pluggy.PluginManager("smalti-compat-probe")
    spec, impl = pluggy.HookspecMarker("smalti-compat-probe"), pluggy.HookimplMarker("smalti-compat-probe")

    class _Spec:
        @spec
        def probe(self) -> None: ...

    class _Impl:
        @impl
        def probe(self) -> None: ...

    pm.add_hookspecs(_Spec)
    pm.register(_Impl())
    caller = pm.hook.probe
    for owner, field in ((pm, "_inner_hookexec"), (caller, "_hookimpls")):
        if not hasattr(owner, field):
            raise unsupported("pluggy", f"{type(owner).__name__}.{field}")
    for field in ("function", "argnames", "hookwrapper", "wrapper"):
        if not hasattr(caller._hookimpls[0], field):
            raise unsupported("pluggy", f"HookImpl.{field}")
    return pm._inner_hookexec


#: What a plugin manager runs hooks with when nobody traces or monitors them (pluggy's ``_multicall``).
PLAIN_HOOKEXEC = _probe_pluggy()


def hook_impls(caller: Any) -> list[Any]:
    """A hook caller's implementation list: pluggy's own list, changed in place as plugins come and go."""
    return caller._hookimpls


def hook_executor(pm: pluggy.PluginManager) -> Any:
    """What ``pm`` runs hook calls with now (not :data:`PLAIN_HOOKEXEC` while tracing or monitoring).

    :class:`~smalti.core.dispatch.FastHook` reads the same field inline on every call, for speed."""
    return pm._inner_hookexec


# --- OmegaConf: a key's value as written (an interpolation unresolved), without resolving it ---
if not (hasattr(DictConfig, "_get_node") and hasattr(OmegaConf.create({"k": 1})._get_node("k"), "_value")):
    raise unsupported("omegaconf", "DictConfig._get_node(key)._value()")


def raw_value(container: Any, key: Any) -> Any:
    """The value of ``container[key]`` as written: ``"${...}"`` interpolations come back unresolved."""
    node = container._get_node(key)
    return node._value() if node is not None else None


PRIVATE_NAMES: dict[str, Any] = {
    "torch._foreach_copy_": foreach_copy_,
    "torch._foreach_lerp_": foreach_lerp_,
    "torch._foreach_mul": foreach_mul,
    "torch._foreach_add_": foreach_add_,
    "torch.nn.modules.batchnorm._BatchNorm": BatchNorm,
    "torch._C._functorch.is_functorch_wrapped_tensor": is_functorch_wrapped_tensor,
    "hydra._internal.defaults_list": hydra_defaults_list,
    "hydra._internal.utils": hydra_internal_utils,
    "pluggy.PluginManager._inner_hookexec": PLAIN_HOOKEXEC,
    "pluggy.HookCaller._hookimpls": hook_impls,
    "omegaconf.DictConfig._get_node": raw_value,
}
