"""Sarathi-Serve in Python: the offline API (`LLM`) and the `sarathi` command.

`import sarathi` stays light: LLM (which imports torch) is loaded on first use.
"""
from shared.sampling import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "InvalidRequestError"]


def __getattr__(name: str):
    if name == "LLM":
        from sarathi.llm import LLM

        return LLM
    raise AttributeError(name)
