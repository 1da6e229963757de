"""A refusal in the caller's terms (issue 55, item 4): the one format of every ``ShapeNotBuilt``.

A component sees latents (``arg[0]=1x4x12x12``) where the user thinks "96x96 was not built; built:
64x64, 64x96". Where ``load_compiled`` knows the pipeline, it gives each dispatcher a :class:`Caller`:
the pipeline (weakly), the policy in the words the user wrote (``on_miss="error"``, or
``strict_shapes=True`` under another policy) and what each built signature is in the pipeline's
terms (:class:`Terms`: height x width, frames, images, text length, guidance), from its entry's
shape and the recipe's warmup. At a refusal the call's own terms are read off the pipeline's
``__call__`` on the stack (its ``height``, ``width``, ``num_frames``, prompts and images per prompt,
at that moment): :func:`refusal` writes what the caller did, what was built, in the same terms,
then the latents. A component called directly (no pipeline call on the stack), or by a pipeline
whose call holds no height and width, gives the latents and says so. Issue 56's refusals (a
scheduler's timestep, a batch that cannot be padded) use the same function.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The policy's words where no load said which (a dispatcher made by hand).
DEFAULT_POLICY = "strict_shapes=True"


def policy_words(on_miss: str, strict_shapes: bool) -> str:
    """How the user asked for refusals: ``on_miss="error"`` (which implies strict shapes) or
    ``strict_shapes=True`` (under ``on_miss="compile"`` or ``"eager"``)."""
    return 'on_miss="error"' if on_miss == "error" else "strict_shapes=True"


@dataclass(frozen=True)
class Terms:
    """A pipeline call as its caller sees it. None: not known (the pipeline takes no such argument)."""

    height: int | None = None
    width: int | None = None
    frames: int | None = None
    #: images (videos) the call makes: prompts x images per prompt
    images: int | None = None
    #: the prompt's length in tokens as the component sees it, where that follows the prompt
    text: int | None = None
    #: classifier-free guidance on, for a pipeline that batches its two halves (SD, SDXL, PixArt)
    guidance: bool | None = None

    @property
    def size(self) -> str:
        if self.height is None or self.width is None:
            return ""
        return (f"{self.frames}x" if self.frames is not None else "") + f"{self.height}x{self.width}"

    @property
    def extras(self) -> str:
        """What the call makes beyond its size: ``1 image, a prompt of 12 tokens, guidance off``."""
        parts = []
        if self.images is not None:
            parts.append(f"{self.images} {'video' if self.frames is not None else 'image'}"
                         f"{'s' if self.images != 1 else ''}")
        if self.text is not None:
            parts.append(f"a prompt of {self.text} tokens")
        if self.guidance is not None:
            parts.append(f"guidance {'on' if self.guidance else 'off'}")
        return ", ".join(parts)

    def __str__(self) -> str:
        size = self.size or "an unknown size"
        return f"{size} ({self.extras})" if self.extras else size

    def as_shape(self, per_prompt: int | None = None) -> str:
        """The recipe shape that builds this call, e.g. ``{height: 96, width: 96}``."""
        parts = [f"height: {self.height}", f"width: {self.width}"]
        if self.frames is not None:
            parts.insert(0, f"num_frames: {self.frames}")
        if per_prompt is not None and per_prompt != 1:
            parts.append(f"batch_size: {per_prompt}")
        return "{" + ", ".join(parts) + "}"


@dataclass(frozen=True)
class Called:
    """Who made a refused call, and its terms: ``how`` is "pipeline" (terms known), "direct" (the
    component called by other code) or "unknown" (a pipeline whose call holds no height and width)."""

    how: str
    terms: Terms | None = None
    pipeline: str = ""
    #: images (videos) per prompt of the call, for the shape that would build it
    per_prompt: int | None = None


class Caller:
    """What a dispatcher knows of who calls it (given by ``load_compiled``)."""

    def __init__(self, pipe: Any, policy: str, built: Mapping[str, Terms], text: Mapping[str, int] | None = None):
        self._pipe = _weak(pipe)
        self.policy = policy
        #: built signature -> its entry's shape in the pipeline's terms
        self.built = dict(built)
        #: built signature -> the prompt length it was built at, where the component's text follows the prompt
        self.text = dict(text or {})

    @property
    def pipe(self) -> Any:
        return self._pipe() if self._pipe is not None else None

    def copied(self, memo: dict[int, Any]) -> Caller:
        """For a deep copy of the pipeline (or of a module): the copy's pipeline where it was copied."""
        pipe = self.pipe
        new = Caller(None, self.policy, self.built, self.text)
        new._pipe = _weak(memo.get(id(pipe), pipe)) if pipe is not None else None
        return new

    def called(self, text: int | None = None) -> Called:
        """The refused call's terms, read off the pipeline's ``__call__`` on the stack."""
        pipe = self.pipe
        frame = pipeline_frame(pipe) if pipe is not None else None
        if frame is None:
            return Called("direct")
        terms, per_prompt = terms_of(frame, pipe)
        if terms.height is None or terms.width is None:
            return Called("unknown", pipeline=type(pipe).__name__)
        if text is not None:
            terms = Terms(terms.height, terms.width, terms.frames, terms.images, text, terms.guidance)
        return Called("pipeline", terms, type(pipe).__name__, per_prompt)


def _weak(value: Any) -> Any:
    if value is None:
        return None
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def pipeline_frame(pipe: Any) -> Mapping[str, Any] | None:
    """The locals of ``pipe``'s ``__call__`` running on this thread's stack, innermost first; None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__call__" and frame.f_locals.get("self") is pipe:
            return frame.f_locals
        frame = frame.f_back
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def terms_of(local: Mapping[str, Any], pipe: Any) -> tuple[Terms, int | None]:
    """A running pipeline call's terms: diffusers' pipelines keep ``height``, ``width``, ``num_frames``,
    ``batch_size`` (the prompts) and ``num_images_per_prompt``/``num_videos_per_prompt`` as locals of
    their ``__call__`` (``orig_height``/``orig_width`` the size asked for where they bin it); guidance
    where the pipeline says (``do_classifier_free_guidance``)."""
    per_prompt = _int(local.get("num_images_per_prompt")) or _int(local.get("num_videos_per_prompt"))
    prompts = _int(local.get("batch_size"))
    images = prompts * (per_prompt or 1) if prompts is not None else None
    try:
        guidance = getattr(pipe, "do_classifier_free_guidance", None)
    except Exception:  # noqa: BLE001 - a property of the pipeline's that cannot answer now
        guidance = None
    # a pipeline that bins the resolution (PixArt, Sana) keeps the size asked for as orig_height, orig_width
    height, width = (_int(local.get("orig_height")), _int(local.get("orig_width"))) if _int(local.get(
        "orig_height")) and _int(local.get("orig_width")) else (_int(local.get("height")), _int(local.get("width")))
    return Terms(height, width, _int(local.get("num_frames")), images, None,
                 guidance if isinstance(guidance, bool) else None), per_prompt


def built_terms(shape: Mapping[str, Any], prompts: int, guidance: bool | None) -> Terms:
    """An entry's shape (``Manifest.shape``) in the pipeline's terms: its images are the recipe's prompts
    times the shape's ``batch_size`` (images per prompt)."""
    return Terms(_int(shape.get("height")), _int(shape.get("width")), _int(shape.get("num_frames")),
                 prompts * (_int(shape.get("batch_size")) or 1), None, guidance)


def _listed(items: Sequence[str]) -> str:
    items = list(dict.fromkeys(items))
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def refusal(component: str, sig: str, built: Sequence[str], caller: Caller | None, describe: Callable[[str], str],
            *, why: str = "", hint: str = "", text: int | None = None, advice: str = "") -> str:
    """The ``ShapeNotBuilt`` message: what the caller did, what was built, in the same terms, then the
    latents (``describe``: the dispatcher's). ``why``: the call is one this cache built but for that
    (a timestep, a batch, a route's own guard); ``hint``: the latents' own advice (a batch); ``text``: the
    call's prompt length where the component's text follows the prompt; ``advice``: what to do, where the
    dispatcher knows it better than these words (a batch between built ones, issue 56: pipeline/batch.py)."""
    policy = caller.policy if caller is not None else DEFAULT_POLICY
    built = sorted(built)
    shown = "; ".join(describe(b) for b in built[:3]) + (f"; +{len(built) - 3} more" if len(built) > 3 else "")
    called_with = f"{component} was called with {describe(sig)}"
    called = caller.called(text) if caller is not None else Called("direct")
    terms = []
    for b in built:
        t = caller.built.get(b) if caller is not None else None
        if t is not None:
            terms.append(Terms(t.height, t.width, t.frames, t.images, caller.text.get(b), t.guidance)
                         if caller is not None and b in caller.text else t)
    if called.how != "pipeline" or not terms:
        who = {"direct": f"{component} was called directly, not by its pipeline, so only its inputs can be compared",
               "unknown": f"{component} was called by {called.pipeline}, whose call does not say its height and "
                          f"width, so only its inputs can be compared"}.get(called.how, "")
        who = f"{who}: " if who else ""
        if why:
            return f"{who}{called_with}, which this cache built, but {why} ({policy}); built: {shown or 'nothing'}"
        how = f"{component} with the inputs its pipeline makes at a built shape" if who else \
            "the pipeline as the recipe's warmup does"
        then = (f"{advice[0].upper()}{advice[1:]}" if advice else
                f"Call {how}, or add the shape to the recipe and rebuild")
        return (f"{who}{called_with}, which this cache did not build ({policy}); built: {shown or 'nothing'}.{hint} "
                f"{then}")
    call = called.terms
    assert call is not None
    terms.sort(key=lambda t: (t.frames or 0, t.height or 0, t.width or 0, t.images or 0))
    latents = f"In latents, {called_with}; built: {shown}"
    if why:
        return (f"{component}: the pipeline was called at {call}, which this cache built, but {why} ({policy}). "
                f"{latents}")
    same = all(t.extras == call.extras for t in terms)
    each = "each " if len({t.size for t in terms}) > 1 else ""
    built_words = (_listed([t.size for t in terms]) + (f" ({each}{call.extras}, as called)" if call.extras else "")
                   if same else _listed([str(t) for t in terms]))
    if advice:  # the dispatcher's own (a batch between built ones)
        pass
    elif call.size not in {t.size for t in terms}:
        advice = (f"call the pipeline at a built size, or add {call.as_shape(called.per_prompt)} to the recipe's "
                  f"shapes and rebuild")
    elif call.images not in {t.images for t in terms if t.size == call.size}:
        advice = ("the images of a call follow its prompts, its images per prompt (a shape's batch_size) and, "
                  "where the pipeline batches guidance's two halves, guidance: call as the recipe's warmup does, or "
                  f"add {call.as_shape(called.per_prompt)} to the recipe's shapes and rebuild")
    elif call.guidance is not None and call.guidance not in {t.guidance for t in terms if t.size == call.size}:
        wanted = "on (guidance_scale above 1)" if call.guidance else "off (guidance_scale: 0)"
        advice = (f"guidance {'on' if call.guidance else 'off'} changes the batch this pipeline calls {component} "
                  f"with (it runs guidance's two halves in one call): call with the guidance of the recipe's warmup, "
                  f"or build a recipe whose warmup has guidance {wanted}")
    elif str(call) in {str(t) for t in terms}:
        advice = (f"the pipeline's call is one this cache built, but {component}'s inputs are not the built ones "
                  f"(below): call it as the recipe's warmup does")
    else:
        advice = "call the pipeline as the recipe's warmup does, or add the shape to the recipe and rebuild"
    return (f"{component}: the pipeline was called at {call}, which this cache did not build ({policy}); built: "
            f"{built_words}. {advice[0].upper()}{advice[1:]}. {latents}")
