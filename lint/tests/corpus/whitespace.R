# Whitespace: trailing, tabs, long lines, blank lines at the end.
x <- 1  
y <- 2	
	z <- 3
  	 w <- 4
s <- "a
  b  
  c"
very_long_line <- c(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19)
exactly_eighty <- c(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 1)
unicode <- "ééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééééé"

  

