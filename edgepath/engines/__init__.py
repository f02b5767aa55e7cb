"""Adapters to heavy engines. Each module imports its engine at import time, so
import one only in the stage that uses it."""
