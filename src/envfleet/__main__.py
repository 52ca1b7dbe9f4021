from envfleet.cli import main

raise SystemExit(main())
