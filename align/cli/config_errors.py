"""Config and command-line errors on one line.

jsonargparse reports a bad value or an unknown key with the whole usage (about fifty lines) and, for a setting of
the model or data class, a nest of union-subtype attempts. :func:`one_line` turns its message into one line that
names the setting, says what was expected, and for an unknown key lists the nearest accepted keys.
A ``class_path`` that does not import is named with the reason and the nearest importable path (:func:`nearest_path`).
:class:`AlignArgumentParser` prints that line (``error: ...`` on stderr, exit status 2) instead of the usage, and
:func:`guarded` does the same for align's own errors (:class:`~align.errors.AlignError`) raised while a command runs.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from align.errors import AlignError

_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_CLASS_PATH = re.compile(r"class_path '([\w.]+)'|class_path='([\w.]+)'")
_EXPECTED = re.compile(r"Expected a <class '([\w.]+)'>\. Got value: (.*)")
_GROUP_OPTION = re.compile(r"Group '([^']+)' does not accept option '([^']+)'")
_SUBCOMMAND_OPTION = re.compile(r"Subcommand '\w+' does not accept option '([^']+)'")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)", re.IGNORECASE)
_NESTED_CLASS = "Problem with given class_path"
_SUBTYPES = re.compile(r"Subtypes: \[(.*)\]\s*$", re.MULTILINE)
_GIVEN = re.compile(r"Given value: (.*?)(?:\. Got value:.*)?$", re.MULTILINE)


def setting_key(key: str) -> str:
    """A key as jsonargparse reports it, as a user writes it: ``--model.init_args.clip.low=x`` -> ``model.clip.low``."""
    key = key.removeprefix("--").split("=", 1)[0]
    return ".".join(part for part in key.split(".") if part != "init_args")


def nearest(key: str, accepted: Iterable[str], n: int = 3) -> list[str]:
    """The accepted keys closest to ``key`` (by spelling), best first; compared on the last part when both are
    dotted under the same parent."""
    accepted = sorted(set(accepted))
    parent, _, leaf = key.rpartition(".")
    siblings = [a for a in accepted if a.rpartition(".")[0] == parent] if parent else []
    if siblings:
        leaves = {a.rpartition(".")[2]: a for a in siblings}
        return [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=n, cutoff=0.6)]
    return difflib.get_close_matches(key, accepted, n=n, cutoff=0.6)


def _suggest(key: str, accepted: Iterable[str]) -> str:
    close = nearest(key, accepted)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _class_settings(path: str) -> list[str]:
    """The constructor arguments of the class at dotted ``path`` (through ``**kwargs`` to its bases), or []."""
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    klass: Any  # a class of the MRO, or the callable itself
    for klass in inspect.getmro(cls) if inspect.isclass(cls) else [cls]:
        init = klass.__init__ if inspect.isclass(cls) else klass
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names += [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(names))


def _value_error(key: str, message: str) -> str | None:
    found = _EXPECTED.search(message)
    if found is None:
        return None
    expected, got = found.group(1), found.group(2).strip()
    return f"--{key}: expected {expected.rsplit('.', 1)[-1]}, got {got!r}"


def _class_error(message: str) -> str:
    """A model/data setting refused inside a class_path: the first subtype's innermost complaint."""
    body = message.split("- Expected a <class 'NoneType'>")[0]
    keys = _PARSER_KEY.findall(body)
    key = ".".join(setting_key(k) for k in keys)
    classes = [a or b for a, b in _CLASS_PATH.findall(body)]
    owner = classes[-1] if classes else ""
    unknown = _NOT_ACCEPTED.search(body)
    if unknown:
        return _unknown_setting(key, unknown.group(1), owner)
    group = _GROUP_OPTION.search(body)
    if group:
        return _unknown_setting(key, f"{group.group(1)}.{group.group(2)}", owner)
    unrecognized = _UNRECOGNIZED.search(body)
    if unrecognized:
        options = [setting_key(a) for a in unrecognized.group(1).split() if a.startswith("--")]
        if options:
            return "; ".join(_unknown_setting(key, option, owner) for option in options)
    matches = list(_PARSER_KEY.finditer(body))
    return _bad_value(key, body[matches[-1].end() :] if matches else body)


def _unknown_setting(key: str, option: str, owner: str) -> str:
    """``--<key>.<option>: <Class> has no setting ...`` with the nearest accepted ones. ``option`` may be dotted (a
    setting inside one of the class's groups)."""
    full = f"{key}.{option}" if key else option
    group, _, leaf = option.rpartition(".")
    fields = _group_settings(owner, group) if group and owner else []
    if fields:  # a setting inside one of the class's option groups (clip.low)
        where, name, settings = f"{owner.rsplit('.', 1)[-1]}.{group}", leaf, fields
    else:
        where, name = owner.rsplit(".", 1)[-1] or "this class", option
        settings = _class_settings(owner) if owner else []
    hint = _suggest(name, settings)
    if not hint and settings:
        hint = f"; accepted: {', '.join(settings[:20])}" + (", ..." if len(settings) > 20 else "")
    return f"--{full}: {where} has no setting '{name}'{hint}"


def _group_settings(owner: str, group: str) -> list[str]:
    """The fields of the dataclass that setting ``group`` (one level) of the class at dotted ``owner`` takes, or []."""
    import dataclasses
    import typing

    module_name, _, name = owner.rpartition(".")
    try:
        init = getattr(importlib.import_module(module_name), name).__init__
        hint = typing.get_type_hints(init).get(group)
    except Exception:  # noqa: BLE001  (only a hint: any failure means no list)
        return []
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return [f.name for f in dataclasses.fields(candidate) if f.init]
    return []


def _top_level(text: str) -> list[str]:
    """``a, b[c, d], e`` -> ``["a", "b[c, d]", "e"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[(" and 1 or ch in "])" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _type_name(text: str) -> str:
    """``<class 'float'>`` -> ``float``; ``typing.Literal['a', 'b']`` -> ``'a', 'b'``; ``NoneType`` -> ``None``."""
    found = re.fullmatch(r"<class '([\w.]+)'>", text)
    if found:
        name = found.group(1).rsplit(".", 1)[-1]
        return "None" if name == "NoneType" else name
    found = re.fullmatch(r"(?:typing\.)?Literal\[(.*)\]", text)
    if found:
        return found.group(1)
    return text.replace("typing.", "")


def _bad_value(key: str, detail: str) -> str:
    """``--key: expected T, got 'v'`` from the text jsonargparse gives after ``Parser key "key":``."""
    value = _value_error(key, detail)
    if value:
        return value
    subtypes = _SUBTYPES.search(detail)
    given = _GIVEN.findall(detail)
    if subtypes:
        names = [n for n in map(_type_name, _top_level(subtypes.group(1))) if n != "None"]
        got = f", got {given[-1].strip()!r}" if given else ""
        return f"--{key}: expected {' or '.join(names)}{got}"
    return f"--{key}: " + " ".join(detail.strip(" :\n").split())


# A dotted name (not a number such as 0.1, the value of an unknown setting).
_NAMED_PATH = re.compile(r"class_path '([A-Za-z_][\w.]*)'|class_path='([A-Za-z_][\w.]*)'|val='([A-Za-z_][\w.]*)'")


def _resolves(path: str) -> bool:
    module_name, _, name = path.rpartition(".")
    try:
        return bool(module_name) and hasattr(importlib.import_module(module_name), name)
    except Exception:  # noqa: BLE001  (a module that fails to import is a path that does not resolve)
        return False


def _import_failure(path: str) -> str:
    """Why ``path`` does not import, on one line."""
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return f"module '{module.__name__}' has no attribute '{name}'"


def nearest_path(path: str) -> str | None:
    """The importable dotted path closest in spelling to ``path``: in the deepest module of it that imports, the
    nearest class (also among the classes of its submodules, for a package that does not export them all), else
    the nearest name or submodule with the rest of ``path`` under it."""
    import pkgutil

    parts = path.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:depth]))
        except Exception:  # noqa: BLE001
            continue
        wanted, rest, prefix = parts[depth], parts[depth + 1 :], ".".join(parts[:depth])
        subs = [m.name for m in pkgutil.iter_modules(getattr(module, "__path__", []))]
        pools: list[dict[str, str]] = []
        if not rest:  # the class itself is misspelt: its module's classes and its submodules'
            deeper = {n: f"{prefix}.{n}" for n in dir(module) if inspect.isclass(getattr(module, n, None))}
            for sub in subs:
                try:
                    members = vars(importlib.import_module(f"{prefix}.{sub}"))
                except Exception:  # noqa: BLE001
                    continue
                deeper.update(
                    {
                        n: f"{prefix}.{sub}.{n}"
                        for n, v in members.items()
                        if inspect.isclass(v) and v.__module__ == f"{prefix}.{sub}" and n not in deeper
                    }
                )
            pools.append(deeper)
        names = [n for n in dir(module) if not n.startswith("_")] + subs
        pools.append({n: ".".join([prefix, n, *rest]) for n in names})
        for pool in pools:
            for match in difflib.get_close_matches(wanted, list(pool), n=3, cutoff=0.6):
                if _resolves(pool[match]):
                    return pool[match]
        return None
    return None


def _unimportable(message: str) -> str | None:
    """``--<setting>: cannot import 'a.b.C' (module 'a.b' has no attribute 'C'); did you mean a.b.D?`` for the
    innermost class path in ``message`` that does not import, else None."""
    found = [m for m in _NAMED_PATH.finditer(message) if "." in (m.group(1) or m.group(2) or m.group(3))]
    for match in reversed(found):
        path = match.group(1) or match.group(2) or match.group(3)
        if _resolves(path):
            continue
        key = ".".join(filter(None, map(setting_key, _PARSER_KEY.findall(message[: match.start()]))))
        close = nearest_path(path)
        hint = f"; did you mean {close}?" if close else ""
        return f"--{key}: cannot import '{path}' ({_import_failure(path)}){hint}"
    return None


def one_line(message: str, accepted: Iterable[str] = ()) -> str:
    """jsonargparse's error ``message`` as one line; ``accepted``: the parser's keys, for unknown-key hints."""
    accepted = list(accepted)
    unimportable = _unimportable(message) if "class_path" in message else None
    if unimportable:
        return unimportable
    if _NESTED_CLASS in message:
        return _class_error(message)
    found = _SUBCOMMAND_OPTION.search(message)
    if found:
        key = found.group(1)
        return f"--{key}: no such setting{_suggest(key, accepted)}"
    found = _UNRECOGNIZED.search(message)
    if found:
        args = found.group(1).split()
        keys = [a[2:].split("=", 1)[0] for a in args if a.startswith("--")]
        if keys:
            return "; ".join(f"--{k}: no such setting{_suggest(k, accepted)}" for k in keys)
        return f"unexpected arguments: {found.group(1)}"
    matches = list(_PARSER_KEY.finditer(message))
    if matches:
        return _bad_value(matches[-1].group(1), message[matches[-1].end() :])
    return " ".join(message.split())


def parser_keys(parser) -> list[str]:
    """Every setting's dotted key in ``parser`` and its subcommand parsers."""
    keys = []
    for action in getattr(parser, "_actions", []):
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict) and all(hasattr(p, "_actions") for p in choices.values()):
            for sub in choices.values():
                keys += parser_keys(sub)
        elif action.dest and action.dest not in ("help", "config"):
            keys.append(action.dest)
    return keys


class AlignArgumentParser(LightningArgumentParser):
    """Lightning's parser, with errors on one line (see :func:`one_line`)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():
            super().error(message, ex)
        sys.stderr.write(f"error: {one_line(str(message), parser_keys(self))}\n")
        self.exit(2)


def guarded(fn):
    """``fn()``, with an :class:`~align.errors.AlignError` (also one raised while jsonargparse instantiates a class)
    printed as ``error: ...`` on stderr and exit status 2."""
    try:
        return fn()
    except AlignError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as err:
        # jsonargparse re-raises errors from class instantiation as a ValueError caused by the original one; an
        # error of a class given by class_path inside a union (``sampling.engine: str | GenerationEngine``) reaches
        # it only as text, one line per union member it tried.
        cause = err.__cause__
        while cause is not None and not isinstance(cause, AlignError):
            cause = cause.__cause__
        message = str(cause) if cause is not None else _own_line(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


_OWN_LINE = re.compile(r"^[ \t]*-[ \t]+((?:model|data|trainer)\.[\w.\[\]]+: .+)$", re.MULTILINE)


def _own_line(err: BaseException | None) -> str | None:
    """The one-line message of an align setting's error (``model.x.y: expected ...``) that jsonargparse kept as text
    in a union's list of failures, anywhere in ``err``'s chain; None when there is none."""
    while err is not None:
        found = _OWN_LINE.search(str(err))
        if found:
            return found.group(1)
        err = err.__cause__ or err.__context__
    return None
