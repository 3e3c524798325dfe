from kvfuzz.cli import main

main()
