import sys
from pathlib import Path

# graph_test_backend.py and oot_pass_example.py are imported by the tests in this folder.
sys.path.insert(0, str(Path(__file__).parent))
