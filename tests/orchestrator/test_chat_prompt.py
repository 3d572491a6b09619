"""How the orchestrator turns a chat into the target's prompt: the roles it takes, and a
chat template's own refusal answered as bad input (never a crash)."""

from types import SimpleNamespace

import pytest

from orchestrator.server import OrchestratorServicer
from specdec.errors import InvalidArgument
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb


class Template:
    chat_template = "ChatML"

    def __init__(self, refuse: str | None = None):
        self.refuse, self.seen = refuse, None

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        if self.refuse:
            raise ValueError(self.refuse)  # jinja2's TemplateError is one; any error is the template's
        self.seen = messages
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}


def prompt(tokenizer, *messages) -> list[int]:
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))
    return OrchestratorServicer.prompt_ids(SimpleNamespace(tokenizer=tokenizer), request)


def test_a_tool_result_is_a_message_the_template_renders():
    tokenizer = Template()
    ids = prompt(tokenizer, ("user", "weather?"), ("assistant", '{"name": "w", "arguments": {}}'), ("tool", "18 C"))
    assert [m["role"] for m in tokenizer.seen] == ["user", "assistant", "tool"]
    assert "".join(map(chr, ids)).endswith("<tool>18 C<assistant>")


def test_a_role_outside_the_chat_roles_and_a_template_refusal_are_bad_input():
    with pytest.raises(InvalidArgument) as role:
        prompt(Template(), ("robot", "hi"))
    assert role.value.field == "chat.messages[0].role"
    with pytest.raises(InvalidArgument) as refused:
        prompt(Template(refuse="Conversation roles must alternate user/assistant"), ("user", "a"), ("user", "b"))
    assert refused.value.field == "chat.messages" and "must alternate" in str(refused.value)
