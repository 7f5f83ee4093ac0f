"""Every public function, method and class of the package has a docstring.

Functions follow TFF's own style: a summary line, then `Args:` naming every
parameter, and `Returns:` (or `Yields:`) when the function returns a value.
Properties need only the summary.
"""

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ('tff_pfl', 'processes', 'deploy')


def _modules():
    for package in PACKAGES:
        yield from sorted((REPO / package).rglob('*.py'))


def _is_property(node):
    for decorator in node.decorator_list:
        name = getattr(decorator, 'id', None) or getattr(decorator, 'attr', None)
        if name in ('property', 'cached_property', 'setter'):
            return True
    return False


def _returns_value(node):
    """Whether `node` itself (not a nested function) returns a value."""
    stack = list(node.body)
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if (
            isinstance(child, ast.Return)
            and child.value is not None
            and not (isinstance(child.value, ast.Constant) and child.value.value is None)
        ):
            return True
        if isinstance(child, (ast.Yield, ast.YieldFrom)):
            return True
        stack.extend(ast.iter_child_nodes(child))
    return False


def _parameters(node):
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if args.vararg:
        names.append(args.vararg.arg)
    if args.kwarg:
        names.append(args.kwarg.arg)
    return [n for n in names if n not in ('self', 'cls')]


def _section(doc, title):
    """The lines of a Google-style section `title:` of `doc`, or None."""
    match = re.search(rf'^(\s*){title}:\s*$', doc, re.MULTILINE)
    if not match:
        return None
    return doc[match.end() :]


def _problems(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    relative = path.relative_to(REPO)
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                if child.name.startswith('_'):
                    continue
                if not ast.get_docstring(child):
                    found.append(f'{relative}: class {prefix}{child.name} has no docstring')
                visit(child, f'{prefix}{child.name}.')
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name.startswith('_'):
                    continue
                name = f'{relative}: {prefix}{child.name}'
                doc = ast.get_docstring(child)
                if not doc:
                    found.append(f'{name} has no docstring')
                    continue
                if _is_property(child):
                    continue
                params = _parameters(child)
                if params:
                    args = _section(doc, 'Args')
                    if args is None:
                        found.append(f'{name}: docstring lacks Args:')
                    else:
                        absent = [p for p in params if not re.search(rf'^\s*\**{re.escape(p)}\b', args, re.MULTILINE)]
                        if absent:
                            found.append(f'{name}: Args: does not name {absent}')
                if _returns_value(child) and _section(doc, 'Returns') is None and (_section(doc, 'Yields') is None):
                    found.append(f'{name}: docstring lacks Returns:')

    visit(tree, '')
    return found


def test_the_checker_catches_what_it_should(tmp_path):
    bad = tmp_path / 'bad.py'
    bad.write_text(
        'def f(a, b):\n'
        '  """Adds.\n\n  Args:\n    a: one.\n  """\n'
        '  return a + b\n'
        'def g():\n  pass\n'
        'class C:\n'
        '  """C."""\n'
        '  @property\n'
        '  def p(self):\n    """P."""\n    return 1\n'
        '  def m(self, x):\n'
        '    """M.\n\n    Args:\n      x: x.\n\n    Returns:\n      x.\n    """\n'
        '    return x\n'
    )
    global REPO
    saved = REPO
    REPO = tmp_path
    try:
        problems = _problems(bad)
    finally:
        REPO = saved
    assert problems == [
        "bad.py: f: Args: does not name ['b']",
        'bad.py: f: docstring lacks Returns:',
        'bad.py: g has no docstring',
    ]


@pytest.mark.parametrize('path', list(_modules()), ids=lambda p: str(p.relative_to(REPO)))
def test_public_api_is_documented(path):
    problems = _problems(path)
    assert not problems, '\n'.join(problems)
