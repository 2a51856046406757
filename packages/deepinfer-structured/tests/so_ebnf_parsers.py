"""Independent recursive-descent recognisers for the EBNF grammars used in the tests."""

from __future__ import annotations

ARITH_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [0-9] | [1-9] [0-9]*
"""

CALLS_EBNF = r"""
root ::= call ("; " call)*
call ::= name "(" args? ")"
args ::= value ("," value)*
value ::= name | "'" [a-z ]* "'"
name ::= [a-z] [a-z_0-9]*
"""


class _Parser:
    def __init__(self, text: str):
        self.s = text
        self.i = 0

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def eat(self, lit: str) -> bool:
        if self.s.startswith(lit, self.i):
            self.i += len(lit)
            return True
        return False

    def expect(self, lit: str) -> None:
        if not self.eat(lit):
            raise SyntaxError(f"expected {lit!r} at {self.i} in {self.s!r}")


def _arith(p: _Parser) -> None:
    def expr():
        term()
        while p.peek() and p.peek() in "+-":
            p.i += 1
            term()

    def term():
        factor()
        while p.peek() and p.peek() in "*/":
            p.i += 1
            factor()

    def factor():
        if p.eat("("):
            expr()
            p.expect(")")
            return
        if not ("0" <= p.peek() <= "9" and p.peek()):
            raise SyntaxError(f"expected number at {p.i} in {p.s!r}")
        if p.peek() == "0":
            p.i += 1  # "0" alone: a leading zero is not followed by more digits ([1-9][0-9]*)
            return
        while p.peek() and "0" <= p.peek() <= "9":
            p.i += 1

    expr()


def _calls(p: _Parser) -> None:
    def name():
        if not ("a" <= p.peek() <= "z"):
            raise SyntaxError(f"expected name at {p.i} in {p.s!r}")
        p.i += 1
        while p.peek() and (("a" <= p.peek() <= "z") or p.peek() == "_" or ("0" <= p.peek() <= "9")):
            p.i += 1

    def value():
        if p.eat("'"):
            while p.peek() and (("a" <= p.peek() <= "z") or p.peek() == " "):
                p.i += 1
            p.expect("'")
        else:
            name()

    def call():
        name()
        p.expect("(")
        if not p.eat(")"):
            value()
            while p.eat(","):
                value()
            p.expect(")")

    call()
    while p.eat("; "):
        call()


def recognises(grammar: str, text: str) -> bool:
    """Whether `text` is a sentence of ARITH_EBNF or CALLS_EBNF (the whole text)."""
    p = _Parser(text)
    try:
        {ARITH_EBNF: _arith, CALLS_EBNF: _calls}[grammar](p)
    except SyntaxError:
        return False
    return p.i == len(text)
