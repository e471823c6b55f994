"""Compiler passes: each is a function from IR to new IR, testable on its own."""
