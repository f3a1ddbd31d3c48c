import sys
from pathlib import Path

# tests/helpers.py is shared by the test modules.
sys.path.insert(0, str(Path(__file__).parent))
