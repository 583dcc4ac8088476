"""hpctrain's layering, by an ast scan of its source (nothing is imported or run).

Every import (in functions too) goes from a part of ``hpctrain/`` (a top-level module or folder) to a part of a
lower layer of ARCHITECTURE.md's list, so no two parts import each other, however indirectly; and no code outside
``comm/`` touches a communicator's private attribute (a name defined as private in ``comm/``, reached through
anything but ``self``).
"""
import ast
import re

from harness import REPO

PKG = REPO / "hpctrain"


def modules():
    """(dotted module name, path, parsed tree) of every Python file of the package."""
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path, ast.parse(path.read_text(), str(path))


def part(module):
    """The part a dotted module belongs to: ``hpctrain.comm.backends.mpi.ulfm`` -> ``comm``; the package itself -> None."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else None


def imported(name, path, tree):
    """(line, module) of every hpctrain module ``tree`` imports, with relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target == "hpctrain" or target.startswith("hpctrain."):
                yield node.lineno, target


def stated_layers():
    """Part -> its layer number, from ARCHITECTURE.md's Layers section ("    3. comm")."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for number, names in re.findall(r"^ {4}(\d+)\. (.+)$", section, re.M):
        for name in names.split():
            layers[name] = int(number)
    return layers


def test_every_import_points_down_the_layers_architecture_md_states():
    layers = stated_layers()
    assert layers, "ARCHITECTURE.md has no numbered list of layers under '## Layers'"
    unplaced, upward = set(), []
    for name, path, tree in modules():
        mine = part(name)
        if mine is None:
            continue                    # (hpctrain/__init__.py: the facade imports what it hands on)
        if mine not in layers:
            unplaced.add(mine)
            continue
        for line, target in imported(name, path, tree):
            theirs = part(target)
            if theirs is None or theirs == mine:
                continue
            if theirs not in layers:
                unplaced.add(theirs)
            elif layers[theirs] >= layers[mine]:
                upward.append(f"{path.relative_to(REPO)}:{line} imports {target} ({mine}, layer {layers[mine]} -> "
                              f"{theirs}, layer {layers[theirs]})")
    assert not unplaced, f"parts not in ARCHITECTURE.md's layers: {sorted(unplaced)}"
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_no_code_outside_comm_touches_a_communicators_private_attributes():
    private = set()
    for _, path, tree in modules():
        if "comm" not in path.relative_to(PKG).parts[:1]:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and re.match(r"_[^_]", node.name):
                private.add(node.name)
    assert {"_rt", "_base", "_backend"} <= private, "the scan no longer sees comm/'s private names"
    reaches = []
    for _, path, tree in modules():
        if path.relative_to(PKG).parts[0] == "comm":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                reaches.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not reaches, "reach-ins into comm/'s private names:\n" + "\n".join(reaches)


def test_features_ask_the_communicator_instead_of_probing_it_with_getattr():
    """``getattr(comm, "name", default)`` on a communicator outside ``comm/`` is a probe the protocol
    (``comm/protocol.py``) makes unneeded: a capability is stated on both communicator kinds."""
    probes = []
    for name, path, tree in modules():
        if part(name) == "comm" or name == "hpctrain.horovod.negotiated":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                target = ast.unparse(node.args[0])
                if re.search(r"(^|[._])(comm|world)(\(\))?$", target):
                    probes.append(f"{path.relative_to(REPO)}:{node.lineno}: getattr({target}, {node.args[1].value!r})")
    assert not probes, "probes of a communicator:\n" + "\n".join(probes)
