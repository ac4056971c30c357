"""Your own reward functions for GRPO: `--reward_funcs pkg.module:function` (TRL's option name; TRL's dotted
`pkg.module.function` too), each imported and checked before any work against TRL's reward-function signature.

TRL 1.16's `GRPOTrainer` calls every reward function by keyword, `f(prompts=..., completions=...,
completion_ids=..., **columns)`, the data's other columns (`answer`, `solution`, ...) and `trainer_state` among the
keywords, and expects one `float` (or `None`: no reward) per completion; so a reward function takes `**kwargs`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from pathlib import Path


FLAG = "--reward_funcs"


def resolve_reward_function(spec: str):
    """The callable named by `spec` (`pkg.module:function`, or `pkg.module.function` as TRL's scripts name it; a
    dotted attribute path after the colon reaches a method or a nested object), checked by `check_reward_signature`.

    Raises `ValueError` naming `--reward_funcs`, the value and what is wrong: not of that form, not importable, no
    such attribute, not callable, or a signature TRL cannot call.

    >>> resolve_reward_function("plugformer.evaluation.rewards:format_reward").__name__
    'format_reward'
    >>> resolve_reward_function("format_reward")
    Traceback (most recent call last):
    ...
    ValueError: --reward_funcs 'format_reward': expected pkg.module:function (or pkg.module.function), a function importable from the Python path
    """
    if not isinstance(spec, str):
        raise ValueError(f"{FLAG} {spec!r}: expected a string pkg.module:function")
    module_name, _, attribute = spec.partition(":") if ":" in spec else spec.rpartition(".")
    module_name, attribute = module_name.strip(), attribute.strip()
    if not module_name or not attribute:
        raise ValueError(
            f"{FLAG} {spec!r}: expected pkg.module:function (or pkg.module.function), a function "
            "importable from the Python path"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a missing module, or one that fails as it imports: either way, one line
        reason = (
            "no such module"
            if isinstance(error, ModuleNotFoundError) and error.name == module_name
            else (f"importing it raised {type(error).__name__}: {error}")
        )
        raise ValueError(
            f"{FLAG} {spec!r}: cannot import {module_name!r} ({reason}); put the folder that holds it "
            "on PYTHONPATH, or pip install it"
        ) from None
    function = module
    for part in attribute.split("."):
        if not hasattr(function, part):
            public = sorted(name for name in vars(module) if not name.startswith("_"))[:12]
            raise ValueError(f"{FLAG} {spec!r}: {module_name!r} has no {attribute!r}; it defines {public}")
        function = getattr(function, part)
    if not callable(function) or inspect.isclass(function):
        raise ValueError(
            f"{FLAG} {spec!r}: {attribute!r} is of type {type(function).__name__}, not a function; expected "
            "f(prompts, completions, **kwargs) -> list[float]"
        )
    check_reward_signature(function, spec)
    return function


def check_reward_signature(function, spec: str) -> None:
    """Raises `ValueError` unless TRL can call `function` as it calls a reward function: every argument by keyword,
    with keywords beyond its named ones (the data's columns), so it must take `**kwargs` and no argument that can
    only be given by position. Named parameters are not checked against the data: `answer` or `solution` is a
    column TRL passes when the data has it."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without an introspectable signature: TRL's own call will tell
        return
    parameters = list(signature.parameters.values())
    shown = f"{getattr(function, '__name__', type(function).__name__)}{signature}"
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise ValueError(
            f"{FLAG} {spec!r}: {shown} takes no **kwargs; TRL calls reward functions as f(prompts=..., "
            "completions=..., completion_ids=..., **columns): add **kwargs"
        )
    by_position = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty]
    if by_position:
        raise ValueError(
            f"{FLAG} {spec!r}: {shown} takes {by_position} by position only; TRL passes every argument "
            "by keyword (prompts, completions, completion_ids and the data's columns)"
        )


def reward_name(function) -> str:
    """The name TRL logs a reward function's metrics under (`rewards/<name>/mean`: `trl.trainer.utils.
    get_callable_name`): a function's `__name__`, a callable object's class name."""
    while hasattr(function, "func") and hasattr(function, "keywords"):  # functools.partial, as TRL unwraps it
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


def reward_record(function, spec: str) -> dict:
    """`run_info.json`'s record of a reward function you gave: its flag value, the name its metrics are logged
    under, and the file it came from with that file's sha256 (a verifier edited later is another reward)."""
    record = {"spec": spec, "name": reward_name(function)}
    try:
        path = Path(inspect.getsourcefile(inspect.unwrap(function)) or "")
    except TypeError:  # a builtin, or a callable object: its class's module holds the code
        path = Path(inspect.getsourcefile(type(function)) or "") if not inspect.isbuiltin(function) else Path()
    if path.is_file():
        record.update(file=str(path.resolve()), sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    return record
