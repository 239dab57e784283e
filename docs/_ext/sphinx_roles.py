"""A griffe extension for the API reference (mkdocs.yml): the docstrings' Sphinx roles become Markdown.

The package's docstrings are Google style with Sphinx cross references (``:class:`~align.models.policy.PolicyModel```,
``:func:`aggregate```, ``:mod:`align.hub```). Each role becomes a cross reference that mkdocstrings resolves
(``[`PolicyModel`][align.models.policy.PolicyModel]``) when its target is an object of ``align`` that the reference
renders, and inline code otherwise (a private helper, ``torch.Tensor``). A name without a module is looked up the way
Sphinx does, from the docstring's object outwards. The reST literal-block marker (a paragraph ending in ``::``)
becomes a plain colon; the indented block after it already reads as code in Markdown.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from griffe import Alias, Extension, Module, NameResolutionError, Object

ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|attr|data|mod|obj|exc|const):`(?P<target>[^`]+)`")
LITERAL_BLOCK = re.compile(r"(?m)(\S)::$|^\s*::$")


class SphinxRoles(Extension):
    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        if pkg.name != "align":
            return
        names: dict[str, list[str]] = {}  # module-level names of the package -> their paths
        for obj in _objects(pkg):
            if obj.parent is not None and obj.parent.is_module:
                names.setdefault(obj.name, []).append(obj.path)
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _markdown(obj.docstring.value, obj, pkg, names)


def _objects(obj: Object) -> Iterator[Object]:
    """``obj`` and every object defined in it, recursively (imported names are not)."""
    yield obj
    for member in obj.members.values():
        if isinstance(member, Object) and member.parent is obj:
            yield from _objects(member)


def _markdown(text: str, obj: Object, pkg: Module, names: dict[str, list[str]]) -> str:
    def role(match: re.Match[str]) -> str:
        target = re.sub(r"\s+", " ", match.group("target")).strip()
        title = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", target)  # :meth:`title <target>`
        target = (title.group("target") if title else target).replace(" ", "")
        short = target.startswith("~")
        target = target.lstrip("~.!").removesuffix("()")
        shown = title.group("title") if title else target.rsplit(".", 1)[-1] if short else target
        path = _resolve(target, obj, pkg, names)
        return f"[`{shown}`][{path}]" if path else f"`{shown}`"

    text = ROLE.sub(role, text)
    return LITERAL_BLOCK.sub(lambda m: f"{m.group(1)}:" if m.group(1) else "", text)


def _resolve(target: str, obj: Object, pkg: Module, names: dict[str, list[str]]) -> str | None:
    """The path to link ``target`` to, as seen from ``obj``: its canonical path when the reference renders it, None
    (inline code) when it does not or is no object of the package. A target named from the package's root that names
    nothing is linked all the same, so that the build reports it."""
    head, _, rest = target.partition(".")
    scope = obj if obj.is_class else obj.parent  # a method's own class, with what it inherits
    try:
        if scope is not None and scope.is_class and head in scope.all_members:
            path = f"{scope.path}.{head}"
        else:
            path = obj.resolve(head) if head != pkg.name else head
    except NameResolutionError:
        found_in = names.get(head, [])  # as Sphinx does: a name defined once in the package needs no module
        if len(found_in) != 1:
            return None
        path = found_in[0]
    if rest:
        path = f"{path}.{rest}"
    if path != pkg.name and not path.startswith(pkg.name + "."):
        return None
    found = _find(path, pkg)
    if found is None:
        return target if head == pkg.name else None
    return found.path if _rendered(found) else None


def _find(path: str, pkg: Module) -> Object | None:
    """The object at ``path`` (inherited members included, aliases followed to their target), None if none is."""
    found: Object | Alias = pkg
    try:
        for part in path.split(".")[1:]:
            found = (found.all_members if found.is_class else found.members)[part]
            if isinstance(found, Alias):
                found = found.final_target
    except Exception:  # noqa: BLE001 - a name griffe cannot follow (an external or a dynamic one)
        return None
    return found if isinstance(found, Object) else None


def _rendered(obj: Object) -> bool:
    """Whether the reference shows ``obj``: public all the way up, documented, and in a layer's page."""
    parts = obj.path.split(".")
    if len(parts) < 2 or any(p.startswith("_") for p in parts):  # mkdocs.yml's filters leave out every _name
        return False
    if parts[1] in ("rewards", "strategies"):  # alias modules of rollout.rewards and trainer.strategies
        return False
    return obj.is_module or obj.has_docstrings
