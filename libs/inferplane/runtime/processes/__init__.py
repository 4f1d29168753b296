"""Child processes and the ports they listen on: process trees that die with their parent
(`procguard`) and free loopback ports below the kernel's ephemeral range (`ports`).
"""
