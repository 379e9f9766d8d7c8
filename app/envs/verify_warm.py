"""Imported by the forkserver of math-verify's process pool (app/envs/jsonl.py `verifier_pool`):
math-verify and sympy are imported, and one comparison runs (its LaTeX grammar loads on the first
call, 0.2-0.3 s), so that every worker forked from it starts warm and its first call is not the
slow one that meets the deadline."""

from app.envs.jsonl import verify_in_process

verify_in_process("The answer is $\\boxed{1}$", "1")
