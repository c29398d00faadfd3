"""The server's logprobs: the builders live in ``kvbalance/llm/logprobs.py``, shared with the Batch API
(``offline/batch_responses.py``), so a server response and a Batch output line render tokens alike."""

from kvbalance.llm.logprobs import TokenText, chat_logprobs, completion_logprobs

__all__ = ["TokenText", "chat_logprobs", "completion_logprobs"]
