"""Kernel backends of flashcore (installed as ``flashcore.backends``).

Each backend is a module answering the contract documented in ``flashcore._dispatch``;
none knows about another, and the front end knows them only through that contract.
"""
