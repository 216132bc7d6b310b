from relaylm.cli import main

main()
