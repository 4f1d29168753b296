"""``CallSyntax``: how one output format writes tool calls, as the decoding constraint needs it.

The parser reads calls through its ``EngineConfig`` (markers, states); the constraint
(``build_tool_constraint``) writes an xgrammar structural tag that lets the model write only
declared calls with schema-valid arguments. Both describe one format, so each format's config
carries its ``CallSyntax`` (``EngineConfig.call_syntax``) beside its markers, and the tag is
built from it for any family. The shapes follow xgrammar 0.2's built-in tags for the same
models (``xgrammar.builtin_structural_tag``: ``kimi``, ``qwen_3``, ``deepseek_v3_1``,
``glm_4_7``, ``harmony``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CallSyntax"]


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """One format's tool-call syntax. A call is written ``call_begin`` (with ``{name}`` the
    function's name), then text matching ``call_id`` (when set), ``args_begin``, the
    arguments, ``call_end``; calls are joined by ``separator`` and, when ``section_begin`` is
    set, wrapped in ``section_begin`` ... ``section_end``.

    Attributes:
        call_begin: the text that opens a call, ``{name}`` standing for the function name
            (``'<tool_call>\\n{"name": "{name}", "arguments": '`` for Qwen3).
        call_end: the text that closes a call (``""`` when a stop token ends it: harmony's
            ``<|call|>``, which xgrammar cannot require under a constraint).
        call_id: a regular expression for the model's own id between the name and the
            arguments (Kimi's ``:{n}`` counter), or None.
        args_begin: the text between the id (or name) and the arguments.
        section_begin: the text that opens all the calls of a response, or ``""``.
        section_end: the text that closes them.
        separator: the text between two calls.
        arguments_style: xgrammar's ``json_schema`` style: None for JSON, ``"glm_xml"`` for
            GLM's ``<arg_key>`` / ``<arg_value>`` pairs.
        trigger: under ``tool_choice: "auto"``, the text whose appearance opens the calls
            (the section marker, or the prefix of ``call_begin`` common to every call).
        reasoning_end: the text that closes reasoning (``</think>``).
        after_reasoning: what a forced call's reasoning block ends with after
            ``reasoning_end`` (Qwen3 writes ``</think>\n\n``; harmony starts its next message
            with ``<|start|>assistant``).
        reasoning_begin: the text that opens reasoning when the model opens it itself.
        optional_reasoning: the model may open a reasoning block itself even when the prompt
            did not (GLM writes ``<think>``, gpt-oss an ``analysis`` message): a forced call
            may then follow such a block instead of coming first.
        reasoning_excludes: text reasoning may not hold (the tool markers: a call is written
            after reasoning, not inside it).
        text_excludes: text the free text of ``auto`` may not hold besides the reasoning
            markers (a call marker outside a section).
        model_writes_think: the model may write ``reasoning_begin`` first although the prompt
            opened reasoning (Qwen3 before 2507), so reasoning may hold it.
        answer_begins: the texts that may open the answer after reasoning, one of which a
            ``response_format`` JSON answer must start with (harmony's ``final`` channel
            header); empty when the answer is plain text.
    """

    call_begin: str
    call_end: str
    trigger: str
    call_id: str | None = None
    args_begin: str = ""
    section_begin: str = ""
    section_end: str = ""
    separator: str = ""
    arguments_style: str | None = None
    reasoning_end: str = "</think>"
    after_reasoning: str = ""
    reasoning_begin: str = "<think>"
    optional_reasoning: bool = False
    reasoning_excludes: tuple[str, ...] = ()
    text_excludes: tuple[str, ...] = ()
    model_writes_think: bool = False
    answer_begins: tuple[str, ...] = ()

    def begin(self, name: str) -> str:
        """``call_begin`` for function ``name``."""
        return self.call_begin.replace("{name}", name)
