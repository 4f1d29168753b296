"""Test fakes and helpers shared by inferplane test suites (fake clock, loop, databases, replica
and picker fakes, tool-schema strategies). No production module imports this package."""
