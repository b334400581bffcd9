"""A Jinja environment that runs untrusted chat templates with bounded work and memory.

Jinja's own sandbox stops a template from reaching Python internals, but not from burning the
machine: `{% for i in range(10**5) %}{% for j in range(10**5) %}...`, `'a' * 10**10`,
`10 ** (10 ** 9)` or `'x' | center(10**10)` hang the process or exhaust memory. Every render here
runs under a `RenderBudget`:

- time: the compiled template calls `environment.tick()` on entering every block body (each loop
  iteration, each `if` branch, each macro call), and every call, filter and operator ticks too;
  past the deadline the render stops;
- size: every value the template builds (strings, lists, big integers) is weighed against one limit,
  proportional to the input (1 MiB + 4x the conversation); operations whose result can be much
  larger than their operands (repetition, powers, padding widths, `replace`, `join`, `indent`,
  format widths) are checked *before* they run, everything else right after;
- output: everything the template writes, `{{ ... }}` values and literal text, counts against the
  same limit.

`include`, `import` and `extends` are refused at compile time (a chat template is one string), and
`lipsum` is gone. Compiling is bounded too: before Jinja parses a template, its tokens are counted
(and the nesting of its brackets measured) by the lexer alone, and before the parsed tree becomes
Python code, the tree's depth and the nesting of its blocks are measured; a template past any of
these limits is refused before the next, costlier step (parser, code generator, Python's compile)
runs. Any breach raises `TemplateBudgetError`; chat_template.py turns every failure into a
`ChatTemplateError`.
"""
from __future__ import annotations

import re
import string
import threading
import time
import types
from collections.abc import Iterable

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateBudgetError", "RenderBudget", "BudgetedEnvironment", "weight", "MAX_INT_BITS", "MAX_RANGE",
           "MAX_TEMPLATE_TOKENS", "MAX_BRACKET_DEPTH", "MAX_TREE_DEPTH", "MAX_BLOCK_DEPTH"]

MAX_INT_BITS = 8192          # integers beyond ~2,500 digits never appear in a prompt
MAX_RANGE = 100_000          # items in one range(); nested loops are bounded by the deadline
# Compile-time limits. Real templates (Llama 3.x, Qwen 2.5/3, SmolLM2: 0.4-4 kB) have at most ~1,000
# Jinja tokens, brackets nested 3 deep, a parse tree 19 deep and blocks nested 5 deep; a 20 kB
# template has ~5,000 tokens. Compiling costs up to ~30 us and ~4 kB per token (lexer, parser, code
# generator and Python's compile), so the worst template under the token limit compiles in about half a
# second; one past it is refused by the lexer alone, after reading the first MAX_TEMPLATE_TOKENS tokens.
MAX_TEMPLATE_TOKENS = 16_384
MAX_BRACKET_DEPTH = 32       # ( [ { nested; each level is a dozen frames of Jinja's recursive parser
MAX_TREE_DEPTH = 64          # parse tree depth: Python's compiler refuses code nested ~200 deep
MAX_BLOCK_DEPTH = 16         # for/if/macro/... nested: Python allows 20 nested loops, 100 indentation levels
_BLOCK_NODES = (nodes.For, nodes.If, nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.With,
                nodes.AssignBlock, nodes.Block, nodes.ScopedEvalContextModifier)
_OPEN_BRACKETS, _CLOSE_BRACKETS = frozenset("([{"), frozenset(")]}")
_FORBIDDEN_NODES = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)
_FORBIDDEN_METHODS = {"translate", "maketrans"}   # one character -> any string: output = input x table


class TemplateBudgetError(jinja2.exceptions.SecurityError):
    """The template needed more time, memory or output than a chat prompt can."""


class RenderBudget:
    """The limits of one render: a deadline and a size limit for every value and for the output."""

    def __init__(self, size_limit: int, seconds: float):
        self.size_limit = size_limit
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.output = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"chat template ran longer than its {self.seconds:g} s budget")

    def check_size(self, size: int, what: str) -> None:
        if size > self.size_limit:
            raise TemplateBudgetError(f"chat template {what} would hold {size:,} characters or items "
                                      f"(limit {self.size_limit:,})")

    def add_output(self, size: int) -> None:
        self.output += size
        if self.output > self.size_limit:
            raise TemplateBudgetError(f"chat template output exceeds {self.size_limit:,} characters")


_active = threading.local()   # one budget per rendering thread


def active_budget() -> RenderBudget:
    budget = getattr(_active, "budget", None)
    if budget is None:
        # no render running: Jinja is trying to fold a constant at compile time; make it wait for run time
        raise nodes.Impossible()
    return budget


class budget_scope:
    """with budget_scope(RenderBudget(...)): render ...   (makes the budget active for this thread)"""

    def __init__(self, budget: RenderBudget):
        self.budget = budget

    def __enter__(self) -> RenderBudget:
        _active.budget = self.budget
        return self.budget

    def __exit__(self, *exc) -> None:
        _active.budget = None


def weight(value, stop: int | None = None) -> int:
    """About how many characters `value` becomes when printed; stops counting once past `stop`.

    A list holding the same 1 MB string 10,000 times costs 80 kB to build but 10 GB to print or join,
    so containers weigh the sum of their elements, not their length.
    """
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    if isinstance(value, float):
        return 24
    if isinstance(value, range):   # weighed without walking it
        return 2 + len(value) * (max(abs(value.start), abs(value.stop)).bit_length() // 3 + 4)
    if isinstance(value, jinja2.utils.Namespace):
        value = value._Namespace__attrs
    items: Iterable[object]
    if isinstance(value, dict):
        items = [x for pair in value.items() for x in pair]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return 16
    total = 2
    for item in items:
        total += weight(item, stop) + 2
        if stop is not None and total > stop:
            break
    return total


# ---------------------------------------------------------------- pre-checks for growing operations

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_FORMAT_SPEC_NUMBERS = re.compile(r"\d+")


def _int_args(args) -> list[int]:
    if isinstance(args, dict):
        args = args.values()
    elif not isinstance(args, (list, tuple)):
        args = [args]
    return [a for a in args if isinstance(a, int) and not isinstance(a, bool)]


def check_percent_format(budget: RenderBudget, fmt: str, args) -> None:
    """'%10000000000d' % 1 or '%*d' % (10**9, 1): the widths are what costs, count them first."""
    total = len(fmt) + weight(args, budget.size_limit)
    for m in _PERCENT_SPEC.finditer(fmt):
        for number in m.groups():
            if number == "*":
                total += sum(abs(a) for a in _int_args(args))
            elif number:
                total += int(number) if len(number) < 12 else budget.size_limit + 1
    budget.check_size(total, "format string")


def check_brace_format(budget: RenderBudget, fmt: str, args, kwargs) -> None:
    """'{:>10000000000}'.format(1) and nested widths '{0:{1}}'.format(1, 10**9)."""
    total = len(fmt) + weight(list(args), budget.size_limit) + weight(kwargs, budget.size_limit)
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # malformed: str.format itself raises
    for _, _, spec, _ in fields:
        if spec:
            if "{" in spec:   # a width taken from the arguments
                total += sum(abs(a) for a in _int_args(list(args)) + _int_args(kwargs))
            for number in _FORMAT_SPEC_NUMBERS.findall(spec):
                total += int(number) if len(number) < 12 else budget.size_limit + 1
    budget.check_size(total, "format string")


def check_repeat(budget: RenderBudget, sequence, count: int) -> None:
    budget.check_size(weight(sequence, budget.size_limit) * max(count, 0), "repetition")


def check_power(base, exponent) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent > MAX_INT_BITS or base.bit_length() * exponent > MAX_INT_BITS:
            raise TemplateBudgetError(f"chat template computes an integer power with more than {MAX_INT_BITS} bits")


def check_int_product(left: int, right: int) -> None:
    if left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateBudgetError(f"chat template computes an integer with more than {MAX_INT_BITS} bits")


_SIZE_PARAMETERS = {"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "batch", "slice",
                    "tojson", "pprint", "truncate"}   # calls whose integer arguments are output sizes


def check_growth_call(budget: RenderBudget, name: str, subject, args, kwargs, method: bool) -> None:
    """Calls whose result can be far larger than what goes in: size it before running it.

    `subject` is the string a method is called on (method=True), or the value a filter is applied to.
    """
    if name in _FORBIDDEN_METHODS:
        raise TemplateBudgetError(f"chat templates cannot call {name}()")
    if name in _SIZE_PARAMETERS:
        for value in _int_args(list(args)) + _int_args(kwargs):
            budget.check_size(abs(value), f"{name}() size argument")
    text = subject if isinstance(subject, str) else ""
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        occurrences = text.count(args[0]) if args[0] else len(text) + 1
        budget.check_size(len(text) + occurrences * len(args[1]), "replace() result")
    elif name == "expandtabs" and args and isinstance(args[0], int):
        budget.check_size(len(text) + text.count("\t") * abs(args[0]), "expandtabs() result")
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else abs(int(width))
        budget.check_size(len(text) + (text.count("\n") + 1) * width, "indent() result")
    elif name == "wordwrap":
        wrapstring = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
        budget.check_size(len(text) * (1 + len(str(wrapstring))), "wordwrap() result")
    elif name == "format" and not method and isinstance(subject, str):   # value|format(...) is value % args
        check_percent_format(budget, subject, kwargs or args)
    elif name == "join":
        if method:   # 'sep'.join(items)
            separator, items = text, (args[0] if args else ())
        else:        # items|join(sep)
            separator, items = (args[0] if args else kwargs.get("d", "")), subject
        if isinstance(items, (list, tuple, str, dict, range)):
            size = weight(items, budget.size_limit) + len(str(separator)) * len(items)
            budget.check_size(size, "join() result")


# ---------------------------------------------------------------- the environment


class BudgetedCodeGenerator(CodeGenerator):
    """Compiles templates with a budget check in every block and around every string concatenation."""

    def blockvisit(self, body, frame) -> None:
        self.writeline("environment.tick()")
        super().blockvisit(body, frame)

    def visit_Output(self, node, frame) -> None:
        literal = sum(len(child.data) for child in node.nodes if isinstance(child, nodes.TemplateData))
        if literal:
            self.writeline(f"environment.count_output({literal})")
        super().visit_Output(node, frame)

    def visit_Concat(self, node, frame) -> None:   # a ~ b
        self.write("environment.checked(")
        super().visit_Concat(node, frame)
        self.write(")")


def _budgeted_filter(name: str, function):
    """Wrap a filter: tick, size its growth before it runs, weigh its result after."""
    pass_arg = getattr(function, "jinja_pass_arg", None)

    def wrapper(*args, **kwargs):
        budget = active_budget()
        budget.tick()
        leading = 1 if pass_arg is not None else 0   # context/environment comes first
        value, params = (args[leading], args[leading + 1:]) if len(args) > leading else (None, ())
        if name == "join" and isinstance(value, types.GeneratorType):   # size it before joining
            value = list(value)
            args = (*args[:leading], value, *params)
        check_growth_call(budget, name, value, params, kwargs, method=False)
        result = function(*args, **kwargs)
        if isinstance(result, types.GeneratorType):
            return result   # lazy (map, select, ...): weighed where it is consumed
        budget.check_size(weight(result, budget.size_limit), f"|{name} result")
        return result

    if pass_arg is not None:
        wrapper.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(function, "__name__", name)
    return wrapper


def _sum_numbers(iterable, attribute=None, start=0):
    """|sum for numbers only: summing lists concatenates them quadratically."""
    if not isinstance(start, (int, float)) or isinstance(start, bool):
        raise TemplateBudgetError("chat templates can only |sum numbers")
    total = start
    for item in iterable:
        if attribute is not None:
            item = item.get(attribute) if isinstance(item, dict) else getattr(item, attribute, None)
        if not isinstance(item, (int, float)):
            raise TemplateBudgetError("chat templates can only |sum numbers")
        total = total + item
        if isinstance(total, int) and total.bit_length() > MAX_INT_BITS:
            raise TemplateBudgetError(f"chat template sum exceeds {MAX_INT_BITS} bits")
    return total


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """Immutable sandbox + the active RenderBudget on every block, call, filter, operator and output."""

    code_generator_class = BudgetedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options):
        # optimized=False: the optimizer would evaluate constant expressions at compile time, unbudgeted
        super().__init__(optimized=False, finalize=self._finalize, **options)
        self.globals.pop("lipsum", None)
        self.globals["range"] = self._range
        self.filters["sum"] = _sum_numbers
        self.filters = {name: _budgeted_filter(name, f) for name, f in self.filters.items()}

    def add_filter(self, name: str, function) -> None:
        self.filters[name] = _budgeted_filter(name, function)

    def parse_checked(self, source: str):
        """Parse, refusing the tags that would load other templates and templates past the compile limits
        (TemplateBudgetError naming the limit); the token count is checked before the parser runs."""
        self._check_tokens(source)
        ast = self.parse(source)
        self._check_tree(ast)
        for node in ast.find_all(_FORBIDDEN_NODES):
            tag = type(node).__name__.lower().replace("fromimport", "from ... import")
            raise jinja2.exceptions.TemplateSyntaxError(
                f"'{tag}' is not allowed: a chat template must be a single self-contained template", node.lineno)
        return ast

    def _check_tokens(self, source: str) -> None:
        """The lexer alone (linear in the source): stops at the first token past a limit."""
        count = depth = 0
        for lineno, kind, value in self.lex(source):
            count += 1
            if count > MAX_TEMPLATE_TOKENS:
                raise TemplateBudgetError(f"chat template has more than {MAX_TEMPLATE_TOKENS:,} Jinja tokens "
                                          f"(the limit; line {lineno})")
            if kind == "operator":
                if value in _OPEN_BRACKETS:
                    depth += 1
                    if depth > MAX_BRACKET_DEPTH:
                        raise TemplateBudgetError(f"chat template nests brackets more than {MAX_BRACKET_DEPTH} "
                                                  f"deep (the limit; line {lineno})")
                elif value in _CLOSE_BRACKETS:
                    depth = max(depth - 1, 0)   # unbalanced brackets are the parser's error

    @staticmethod
    def _check_tree(ast: nodes.Template) -> None:
        """Depth of the parse tree and nesting of blocks, walked without recursion."""
        stack: list[tuple[nodes.Node, int, int]] = [(ast, 1, 0)]
        while stack:
            node, depth, blocks = stack.pop()
            if depth > MAX_TREE_DEPTH:
                raise TemplateBudgetError(f"chat template's parse tree is more than {MAX_TREE_DEPTH} deep "
                                          f"(the limit; line {node.lineno})")
            if isinstance(node, _BLOCK_NODES):
                blocks += 1
                if blocks > MAX_BLOCK_DEPTH:
                    raise TemplateBudgetError(f"chat template nests blocks (for, if, macro, ...) more than "
                                              f"{MAX_BLOCK_DEPTH} deep (the limit; line {node.lineno})")
            elifs = {id(e) for e in node.elif_} if isinstance(node, nodes.If) else set()
            for child in node.iter_child_nodes():
                if id(child) in elifs:   # elif: the same level as its if, as in the generated Python
                    stack.append((child, depth, blocks - 1))
                else:
                    stack.append((child, depth + 1, blocks))

    # called from the compiled template code
    def tick(self) -> None:
        active_budget().tick()

    def count_output(self, size: int) -> None:
        active_budget().add_output(size)

    def checked(self, value):
        budget = active_budget()
        budget.check_size(weight(value, budget.size_limit), "string")
        return value

    def _finalize(self, value):
        budget = active_budget()
        budget.add_output(weight(value, budget.size_limit))
        return value

    def _range(self, *args):
        budget = active_budget()
        budget.tick()
        numbers = range(*args)
        if len(numbers) > MAX_RANGE:
            raise TemplateBudgetError(f"range of {len(numbers):,} items; chat templates are limited to {MAX_RANGE:,}")
        return numbers

    def call_binop(self, context, operator, left, right):
        budget = active_budget()
        budget.tick()
        if operator == "**":
            check_power(left, right)
        elif operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                check_int_product(left, right)
            elif isinstance(right, int) and not isinstance(left, (int, float)):
                check_repeat(budget, left, right)
            elif isinstance(left, int) and not isinstance(right, (int, float)):
                check_repeat(budget, right, left)
        elif operator == "+" and not isinstance(left, (int, float)):
            budget.check_size(weight(left, budget.size_limit) + weight(right, budget.size_limit), "concatenation")
        elif operator == "%" and isinstance(left, str):
            check_percent_format(budget, left, right)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value):
        """str.format / format_map, as Jinja wraps them at attribute access, with their widths sized first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked_format(*args, **kwargs):
            budget = active_budget()
            if is_map:
                check_brace_format(budget, fmt, (), args[0] if len(args) == 1 and isinstance(args[0], dict) else {})
            else:
                check_brace_format(budget, fmt, args, kwargs)
            return wrapped(*args, **kwargs)

        return checked_format

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        budget = active_budget()
        budget.tick()
        if isinstance(__obj, types.BuiltinMethodType) and not isinstance(__obj.__self__, types.ModuleType):
            if __obj.__name__ == "join" and args and isinstance(args[0], types.GeneratorType):
                args = (list(args[0]), *args[1:])   # size it before joining
            check_growth_call(budget, __obj.__name__, __obj.__self__, args, kwargs, method=True)
        result = super().call(__context, __obj, *args, **kwargs)
        if not isinstance(result, types.GeneratorType):
            budget.check_size(weight(result, budget.size_limit), "call result")
        return result
