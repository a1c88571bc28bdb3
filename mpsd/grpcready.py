"""Imported first by the packages that hold generated gRPC code (mpsd.plugin, mpsd.dra): raises
mpsd.errors.DependencyError, one line, when grpcio or protobuf is too old (mpsd/grpcdeps.py)."""

from .grpcdeps import require

require()
