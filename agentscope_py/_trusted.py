"""`Trusted`: events and messages the runtime builds from values it already holds, without
validating them again (internal). The one place in the package that sets pydantic's slots.

Validation belongs where values enter: the caller's input, what a middleware emits, anything
deserialised, a tool's arguments. The events and messages the runtime makes itself between those
points hold values that already have their field's type: ids the runtime generated, ``str`` fields
read from events and messages that were validated when they were made, text a provider's reader
decoded, enum members, a `ChatUsage` or a `Msg` instance. Those are built here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, ClassVar, Generic, TypeVar, cast

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = [
    "DeltaShape", "EventShape", "Shape", "Trusted", "delta_maker", "delta_shape", "record_writers", "shape",
    "trusted", "validated", "with_metadata", "with_source",
]

_M = TypeVar("_M", bound=BaseModel)

_new = object.__new__
# pydantic's own slots of a model, set through their descriptors (what ``__copy__`` sets through
# ``object.__setattr__``, without finding the descriptor by name on each object)
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__
_IMMUTABLE = (str, int, float, bool, type(None), tuple, frozenset)

_STR = {str}
_SOURCE = frozenset({"source"})
_METADATA = frozenset({"metadata"})


class Trusted:
    """The shape of one model class built from trusted values, and the builders that use it.

    What every builder here makes is the object the validating constructor (or ``model_copy``)
    makes: the same ``__dict__`` (every field, in the class's field order, defaults and default
    factories applied), the same ``model_fields_set``, no extras, no private attributes
    (`tests/test_trusted.py` and `tests/test_events.py` compare them class by class). Three forms:

    * `shape` (``shape(C, *names).build(**values)``, the shape a module constant): ``C(**values)``
      for the messages the runtime rebuilds once per round — the reply and the tool results from
      the chains' events (with their blocks), the tool-result message, the user's text as a
      message, a sum of usages; `build` (``trusted(C, **values)``) finds the shape per call. A
      shape whose defaults are an event's (``id``, ``created_at``, ``metadata``) is an
      `EventShape`, which sets those three without a loop;
    * `delta_maker` (``delta_maker(C, **ids)(text)``): ``C(**ids, delta=text)``, for the per-token
      deltas `PartsManager` and the acting path make (``functools.partial`` of `_delta` over a
      template: a maker lives as long as its block streams, and a served process holds thousands
      open, so it is a few objects for the collector, not a closure's cells). `PartsManager`,
      which opens a block per text, thinking or tool call and holds its ids as exact ``str``,
      takes its makers from the class's `DeltaShape` (``delta_shape(C).maker(**ids)``, the shape
      a module constant), which checks only how many ids it is given;
    * `with_source` / `with_metadata`: ``ev.model_copy(update={name: value})``, for the
      runtime's own annotations (a sub-agent's events forwarded with their ``source``, the
      budget's ``metadata``), without ``model_copy``'s generic update machinery;
    * `record_writers` (``record_writers(C)``): the slot writes of a frozen dataclass with slots,
      for a site that builds one per model call from values it holds (the `ModelRequest`).

    Why: a shape builds an object from exact-typed values with less work than pydantic-core's
    validation, and the objects of one shape share one fields set where validation makes a new
    set per object, which is what a run in flight keeps (its messages); the counts are in
    benchmarks/RESULTS.md ("What a run costs the tree"). A flat event gains least (pydantic-core
    validates it in about what assembling it in Python costs); the events made once per round (a
    run's start, result and end, a model call's and its blocks' brackets) are built by shapes all
    the same, each from exact-typed values only (a value of another type goes to `Shape.validated`).
    ``Model.model_construct`` is not used: it loops over the fields in Python and inspects each
    default factory's signature on every call, which costs more than validating.

    Only for:

    * frozen models without validators, extras, private attributes or mutable static defaults
      (checked when a class is first used: a class that gains one fails loudly here instead of
      silently skipping its validation). Frozen is what makes sharing a fields set safe: nothing
      mutates it (pydantic's ``model_copy`` copies it before updating);
    * values of each field's exact type, which the caller guarantees. A value from outside — a
      session id the caller chose, an event a middleware derived with ``model_copy`` — goes
      through the validating constructor instead (`validated`, the same signature), which says
      what is wrong.
    """

    __slots__ = ("factories", "name", "required", "template")

    _shapes: ClassVar[dict[type[BaseModel], Trusted]] = {}
    _plans: ClassVar[dict[tuple[Any, ...], Shape[Any]]] = {}  # per class and names given (a few dozen in all)
    _deltas: ClassVar[dict[type[BaseModel], DeltaShape[Any]]] = {}  # per delta class (`delta_maker`)

    def __init__(self, cls: type[BaseModel]) -> None:
        decorators = cls.__pydantic_decorators__
        config = cls.model_config
        if (decorators.field_validators or decorators.model_validators or decorators.validators
                or decorators.root_validators or cls.__private_attributes__ or not config.get("frozen")
                or config.get("extra") not in (None, "ignore") or cls.__pydantic_post_init__):
            raise TypeError(f"{cls.__name__} needs validation: build it with its constructor")
        self.name = cls.__name__
        self.template: dict[str, Any] = {}
        self.required: list[str] = []
        self.factories: dict[str, Callable[[], Any]] = {}
        for name, field in cls.model_fields.items():
            if field.default_factory is not None:
                if field.default_factory_takes_validated_data:
                    raise TypeError(f"{cls.__name__}.{name}'s default needs the validated data: build it with "
                                    "its constructor")
                self.template[name] = None
                self.factories[name] = cast("Callable[[], Any]", field.default_factory)
            elif field.default is PydanticUndefined:
                self.template[name] = None  # given every time (checked once per combination of names)
                self.required.append(name)
            elif isinstance(field.default, _IMMUTABLE):
                self.template[name] = field.default
            else:
                raise TypeError(f"{cls.__name__}.{name} has a mutable default: build it with its constructor")

    @classmethod
    def of(cls, model: type[BaseModel]) -> Trusted:
        shape = cls._shapes.get(model)
        if shape is None:
            shape = cls._shapes[model] = Trusted(model)
        return shape

    def plan(self, cls: type[_M], names: tuple[str, ...]) -> Shape[_M]:
        """``cls`` (this shape's class) built from the fields ``names``."""
        given = set(names)
        unknown, missing = given - self.template.keys(), set(self.required) - given
        if unknown or missing:
            raise TypeError(f"trusted({self.name}): unknown {sorted(unknown)}, missing {sorted(missing)}")
        factories = tuple((name, f) for name, f in self.factories.items() if name not in given)
        if [name for name, _ in factories] == ["id", "created_at", "metadata"] and factories[2][1] is dict:
            return EventShape(cls, self.template, factories, given)
        return Shape(cls, self.template, factories, given)

    # -- the builders ------------------------------------------------------------------------------

    @staticmethod
    def build(cls: type[_M], /, **values: Any) -> _M:
        """``cls(**values)`` without validating ``values``: only for values of each field's type
        that the runtime holds, and every required field given. A site that always gives the same
        fields holds their `shape` instead."""
        key = (cls, *values)
        plan: Shape[_M] | None = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = Trusted.of(cls).plan(cls, tuple(values))
        return plan.build(**values)

    @staticmethod
    def shape(cls: type[_M], /, *names: str) -> Shape[_M]:
        """The builder of ``cls`` from the fields ``names``, made once where a site that always
        gives those fields is defined: ``shape(C, "a", "b").build(a=x, b=y)`` is
        ``trusted(C, a=x, b=y)`` without finding the plan for ``a`` and ``b`` on every call."""
        return Trusted.of(cls).plan(cls, names)

    @staticmethod
    def validated(cls: type[_M], /, **values: Any) -> _M:
        """``cls(**values)``: `build`'s signature, for a site that picks one of the two by whether
        its values are typed."""
        return cls(**values)

    @staticmethod
    def delta_maker(cls: type[_M], **bound: Any) -> Callable[[str], _M]:
        """``delta_maker(C, **ids)(text)`` gives the event ``C(**ids, delta=text)`` gives (a fresh
        ``id``, ``created_at`` and ``metadata`` each). ``ids``: every required field of ``C`` but
        ``delta``; only for values the runtime made itself. Ids that are not exactly ``str`` (a
        provider's tool name of another type) get a maker that validates. A site that makes a
        maker per block from ids it holds as exact ``str`` holds the class's `delta_shape`
        instead, which checks neither the names nor the types on each block."""
        kind: DeltaShape[_M] | None = Trusted._deltas.get(cls)
        if kind is None:
            kind = Trusted._deltas[cls] = Trusted.delta_shape(cls)
        if bound.keys() != kind.names:
            raise TypeError(f"delta_maker({cls.__name__}) takes {', '.join(kind.names)}")
        if set(map(type, bound.values())) != _STR:
            return lambda delta: cls.model_validate({**bound, "delta": delta})
        return kind.maker(**bound)

    @staticmethod
    def delta_shape(cls: type[_M], /) -> DeltaShape[_M]:
        """The maker of ``cls``'s delta makers (`DeltaShape.maker`), made once where a site that
        opens blocks of ``cls`` is defined."""
        trusted = Trusted.of(cls)
        if "delta" not in trusted.required:
            raise TypeError(f"delta_maker({cls.__name__}): no delta field")
        if trusted.factories.keys() != {"id", "created_at", "metadata"} or trusted.factories["metadata"] is not dict:
            raise TypeError(f"delta_maker({cls.__name__}): not an event's defaults: build it with its constructor")
        ids = tuple(name for name in trusted.required if name != "delta")  # (in field order)
        return DeltaShape(trusted.plan(cls, (*ids, "delta")), ids)

    @staticmethod
    def record_writers(cls: type[Any], /) -> tuple[Callable[[Any, Any], None], ...]:
        """The writes of the slots of ``cls``, a frozen dataclass with slots whose ``__init__``
        only sets its fields (no ``__post_init__``, every field in ``__init__``), in field order:
        ``made = object.__new__(cls)`` then each field's write is ``cls(*values)``, without the
        name lookup ``object.__setattr__`` makes per field in the dataclass's ``__init__``. For
        values of each field's type only, every field written (`tests/test_trusted.py` compares
        the object with the constructor's)."""
        params = getattr(cls, "__dataclass_params__", None)
        fields = dataclasses.fields(cls) if params is not None else ()
        if (params is None or not params.frozen or "__slots__" not in cls.__dict__ or hasattr(cls, "__post_init__")
                or not all(f.init for f in fields)):
            raise TypeError(f"{cls.__name__} is not a frozen dataclass with slots and a plain __init__: build it "
                            "with its constructor")
        return tuple(cls.__dict__[f.name].__set__ for f in fields)

    @staticmethod
    def _delta(cls: type[_M], template: dict[str, Any], fields_set: set[str], ids: Iterator[str],
               now: Callable[[], float], delta: str) -> _M:
        # Once per streamed token: the id and the time taken directly, no loop (see `delta_maker`).
        values = template.copy()
        values["id"] = next(ids)
        values["created_at"] = now()
        values["metadata"] = {}
        values["delta"] = delta
        made: _M = _new(cls)
        _set_dict(made, values)
        _set_fields_set(made, fields_set)
        _set_extra(made, None)
        _set_private(made, None)
        return made

    @staticmethod
    def with_source(ev: _M, source: str) -> _M:
        """``ev.model_copy(update={"source": source})``: the same ``__dict__`` but ``source``, the
        fields set plus ``source``, the same extras and private attributes; for the events a
        sub-agent forwards into its caller's stream (one per event, `agent/_subagent.py`).
        ``source``: a ``str`` the runtime made (the agent path). Models are frozen, so a copy never
        changes the original that an inner layer may still hold."""
        return _with(ev, "source", source, _SOURCE)

    @staticmethod
    def with_metadata(ev: _M, metadata: dict[str, Any]) -> _M:
        """``ev.model_copy(update={"metadata": metadata})`` the same way, for an annotation a
        middleware adds as the event passes (`BudgetMiddleware`'s, one per model call).
        ``metadata``: a new ``dict`` of the caller's."""
        return _with(ev, "metadata", metadata, _METADATA)


class Shape(Generic[_M]):
    """`Trusted.build` for one class and one set of fields given (`Trusted.shape`): the template,
    the default factories of the fields not given and the fields set, worked out once."""

    __slots__ = ("cls", "factories", "fields_set", "size", "template")

    def __init__(self, cls: type[_M], template: dict[str, Any], factories: tuple[tuple[str, Callable[[], Any]], ...],
                 fields_set: set[str]) -> None:
        self.cls = cls
        self.template = template
        self.factories = factories
        self.fields_set = fields_set
        self.size = len(fields_set)

    def build(self, /, **values: Any) -> _M:
        """``cls(**values)`` without validating ``values`` (what `Trusted.build` says of them);
        ``values``: the fields of this shape."""
        template = self.template
        fields = {**template, **values}
        if len(values) != self.size or len(fields) != len(template):
            raise self.wrong(values)
        for name, factory in self.factories:
            fields[name] = factory()
        made: _M = _new(self.cls)
        _set_dict(made, fields)
        _set_fields_set(made, self.fields_set)
        _set_extra(made, None)
        _set_private(made, None)
        return made

    def validated(self, /, **values: Any) -> _M:
        """``cls(**values)``: `build`'s signature, for a site that picks one of the two by whether
        its values are typed."""
        return self.cls(**values)

    def wrong(self, values: dict[str, Any]) -> TypeError:
        """What `build` raises when ``values`` are not this shape's fields."""
        return TypeError(f"trusted({self.cls.__name__}) takes {', '.join(sorted(self.fields_set))}, "
                         f"not {', '.join(values)}")


class EventShape(Shape[_M]):
    """A `Shape` whose defaults are an event's (an ``id``, ``created_at`` and an empty
    ``metadata``: most objects a run builds), set without a loop over the factories."""

    __slots__ = ("ids", "now")

    def __init__(self, cls: type[_M], template: dict[str, Any], factories: tuple[tuple[str, Callable[[], Any]], ...],
                 fields_set: set[str]) -> None:
        super().__init__(cls, template, factories, fields_set)
        self.ids = _ids_of(factories[0][1])
        self.now = factories[1][1]

    def build(self, /, **values: Any) -> _M:
        template = self.template
        fields = {**template, **values}
        if len(values) != self.size or len(fields) != len(template):
            raise self.wrong(values)
        fields["id"] = next(self.ids)
        fields["created_at"] = self.now()
        fields["metadata"] = {}
        made: _M = _new(self.cls)
        _set_dict(made, fields)
        _set_fields_set(made, self.fields_set)
        _set_extra(made, None)
        _set_private(made, None)
        return made


class DeltaShape(Generic[_M]):
    """The delta makers of one delta class (`Trusted.delta_shape`): ``maker(**ids)`` is
    ``delta_maker(C, **ids)`` for ids the caller holds as exact ``str`` (its own ids, names a
    Start was validated with), so a block's maker costs a template and a ``partial``, with only
    the length checks `Shape.build` makes on what it is given."""

    __slots__ = ("cls", "fields_set", "ids", "names", "now", "size", "template")

    def __init__(self, plan: Shape[_M], ids: tuple[str, ...]) -> None:
        self.cls = plan.cls
        self.names = dict.fromkeys(ids).keys()
        self.size = len(ids)
        self.template = plan.template
        self.fields_set = plan.fields_set
        factories = dict(plan.factories)
        self.ids = _ids_of(factories["id"])
        self.now: Callable[[], float] = factories["created_at"]

    def maker(self, /, **ids: str) -> Callable[[str], _M]:
        """``delta_maker(cls, **ids)``: ``ids`` every required field but ``delta``, each exactly ``str``."""
        template = self.template
        values = {**template, **ids}
        if len(ids) != self.size or len(values) != len(template):
            raise TypeError(f"delta_maker({self.cls.__name__}) takes {', '.join(self.names)}, not {', '.join(ids)}")
        return partial(Trusted._delta, self.cls, values, self.fields_set, self.ids, self.now)


_NEVER = object()


def _ids_of(factory: Callable[[], str]) -> Iterator[str]:
    """An iterator whose each ``next`` is a ``factory()``: the events' builders take their ids
    with ``next(ids)``. An id factory that is an iterator's ``__next__`` (`message.id_factory`,
    every event's) gives that iterator itself, which ``next`` steps with no method-wrapper call
    in between; any other factory is called by ``iter(factory, sentinel)``'s iterator."""
    owner = getattr(factory, "__self__", None)
    if getattr(factory, "__name__", None) == "__next__" and isinstance(owner, Iterator):
        return owner
    return iter(factory, _NEVER)


def _assemble(cls: type[_M], fields: dict[str, Any], fields_set: set[str],
              extra: dict[str, Any] | None = None, private: dict[str, Any] | None = None) -> _M:
    """The model ``cls`` with ``fields`` as its ``__dict__``, through pydantic's own slots (what
    ``__copy__`` sets). `Shape.build`, `EventShape.build` and `Trusted._delta`, which make nearly
    every object here, set the same slots in line, with no extras and no private attributes."""
    made: _M = _new(cls)
    _set_dict(made, fields)
    _set_fields_set(made, fields_set)
    _set_extra(made, extra)
    _set_private(made, private)
    return made


def _with(ev: _M, name: str, value: Any, field: frozenset[str]) -> _M:
    """``ev`` with one field replaced (``field`` is ``{name}``), its extras and private attributes kept."""
    values = ev.__dict__.copy()
    values[name] = value
    return _assemble(type(ev), values, ev.__pydantic_fields_set__ | field, ev.__pydantic_extra__,
                     ev.__pydantic_private__)


_PLANS = Trusted._plans
trusted = Trusted.build
shape = Trusted.shape
validated = Trusted.validated
delta_maker = Trusted.delta_maker
delta_shape = Trusted.delta_shape
record_writers = Trusted.record_writers

with_source = Trusted.with_source
with_metadata = Trusted.with_metadata
