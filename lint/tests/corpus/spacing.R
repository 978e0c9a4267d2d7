# Spaces around operators, commas and parentheses.
x <- 1+2
y <- 3 *4
z <- 5/ 6
w <- x==y
v <- x!=y
u <- x&y
s <- x|y
r <- x%in%y
q <- x %in% y
p <- -x
o <- !x
n <- x^2
m <- x:y
l <- c(1,2, 3)
k <- c(1 ,2)
j <- x[1,]
i <- x[, 1]
h <- x[ 1]
g <- x[1 ]
f <- c( 1)
e <- c(1 )
d <- mean (x)
cc <- function (x) x
b <- function(x)x
if(x) y
while(FALSE) y
for(i in 1:2) print(i)
if (x)y
a <- x -(1)
aa <- x *(2)
ab <- c(1,(2))
ac <- x[[ 1]]
ad <- x[[1 ]]
ae <- f( )
af <- alist(a = , b = )
ag <- x<-1
ah <- y~x
ai <- ~x
aj <- f(a=1)
ak <- function(a=1) a
al <- x %>% f
am <- x%>%f
an <- x - 1
ao <- (x + 1) * (y- 2)
ap <- base::mean(x)
aq <- base::mean (x)
ar <- list(a = 1, b = 2)$a
as <- x[-1]
